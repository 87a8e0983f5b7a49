"""rewardplane: reward models as Kubernetes GPU inference services, with in-memory weight pushes."""

__version__ = "0.1.0"
