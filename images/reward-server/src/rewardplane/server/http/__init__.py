"""The HTTP side of the reward server: the FastAPI app, its routers, and the scoring path every route shares."""
