"""Reading a process reward model's step rows out of vLLM's token-classification output. Pure."""

from __future__ import annotations


def rows_at_tags(
    data: list[list[float]], ids: list[int], tags: list[int], *, tag_id: int, selected: bool
) -> list[list[float]] | None:
    """The rows of ``data`` at ``tags`` (positions of step tags in the prompt ``ids``).

    ``selected``: vLLM's STEP pooler kept only the rows of the tokens equal to ``tag_id``, in order (a
    different count means vLLM did not apply it, and is an error rather than wrong scores). Otherwise
    ``data`` holds one row per computed token, the prompt's last ``len(data)`` tokens (all of them
    unless a cached prefix was read): None when a wanted tag lies in the part not computed.
    """
    prompt_len = len(ids)
    if selected:
        at = {pos: k for k, pos in enumerate(i for i, t in enumerate(ids) if t == tag_id)}
        if len(data) != len(at):
            raise RuntimeError(
                f"vLLM's STEP pooling gave {len(data)} rows for {len(at)} step tags (of a {prompt_len}-token "
                "prompt): it was not applied to this model's head; restart the server with --prm-pooling token"
            )
        return [data[at[t]] for t in tags]
    offset = prompt_len - len(data)
    if offset < 0:
        raise RuntimeError(f"vLLM gave {len(data)} token rows for a {prompt_len}-token prompt")
    if any(t < offset for t in tags):
        return None
    return [data[t - offset] for t in tags]
