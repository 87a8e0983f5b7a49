"""The kubelet's restart policy for crashed containers, as pure functions the node agent applies.

What the kubelet does (``kuberuntime_manager.doBackOff`` with ``flowcontrol.Backoff``, initial
10 s, maximum 300 s): a container that exits is restarted at once the first time; each later
crash waits the current back-off, which then doubles (10, 20, 40, ... s, at most 5 minutes), and
the pod shows ``CrashLoopBackOff`` meanwhile. A container that ran longer than twice the maximum
(10 minutes) since its last restart starts over: restarted at once, the next back-off 10 s.

With ``terminationMessagePolicy: FallbackToLogsOnError`` a container that failed without writing a
termination message gets the tail of its log as ``lastState.terminated.message`` instead: the last
80 lines, at most 2048 bytes (``MaxContainerTerminationMessageLogLines`` / ``...LogLength``).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_MESSAGE_LINES = 80
MAX_MESSAGE_BYTES = 2048


@dataclass(frozen=True)
class RestartBackOff:
    initial_s: float = 10.0
    max_s: float = 300.0

    @property
    def reset_after_s(self) -> float:
        return 2 * self.max_s  # flowcontrol.Backoff's hasExpired: 2 x the maximum

    def after_exit(self, backoff_s: float | None, ran_s: float) -> tuple[float, float]:
        """``(delay before the restart, back-off remembered for the next crash)``, given the
        back-off remembered so far (None: never crashed) and how long the process ran."""
        if backoff_s is None or ran_s > self.reset_after_s:
            return 0.0, self.initial_s
        return backoff_s, min(2 * backoff_s, self.max_s)


KUBELET = RestartBackOff()


def crash_loop_message(delay_s: float, container: str, pod: str, namespace: str, uid: str) -> str:
    """The kubelet's waiting message during a back-off (``format.Pod``: name_namespace(uid))."""
    return f"back-off {delay_s:g}s restarting failed container={container} pod={pod}_{namespace}({uid})"


def fallback_termination_message(log_text: str) -> str:
    """The tail of a failed container's log, as the kubelet keeps it (80 lines, 2048 bytes)."""
    lines = log_text.splitlines(keepends=True)[-MAX_MESSAGE_LINES:]
    data = "".join(lines).encode("utf-8", "replace")[-MAX_MESSAGE_BYTES:]
    return data.decode("utf-8", "ignore")
