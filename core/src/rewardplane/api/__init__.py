"""The resource API: names and labels of the custom resources (``names``), the typed RewardModel
spec (``spec``), its status vocabulary (``status``), the WeightSync resource (``weightsync``) and a small
REST client (``kube``). The operator writes these resources; the SDK and the CLI read them."""
