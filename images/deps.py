"""Print the third-party requirements of rewardplane distributions, one per line, for pip -r.

    python3 images/deps.py core/pyproject.toml:kube operator/pyproject.toml

``path:extra,extra`` adds those optional-dependency groups. The project's own distributions
(rewardplane-*) are left out: the image builds install them afterwards, from the source, so
that a change to the code does not reinstall the dependencies (a layer of its own).
"""

from __future__ import annotations

import sys

import tomllib


def main(args: list[str]) -> None:
    seen: list[str] = []
    for arg in args:
        path, _, extras = arg.partition(":")
        with open(path, "rb") as f:
            project = tomllib.load(f)["project"]
        reqs = list(project.get("dependencies", []))
        for extra in filter(None, extras.split(",")):
            reqs += project.get("optional-dependencies", {})[extra]
        seen += [r for r in reqs if not r.startswith("rewardplane") and r not in seen]
    print("\n".join(seen))


if __name__ == "__main__":
    main(sys.argv[1:])
