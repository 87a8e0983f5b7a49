"""The node agent's restart policy is the kubelet's: at once, then 10, 20, 40 ... s, at most
5 minutes, starting over after 10 minutes of running; the failed log's tail as the cause."""

from __future__ import annotations

from rewardplane.localcluster.backoff import (
    KUBELET,
    RestartBackOff,
    crash_loop_message,
    fallback_termination_message,
)


def _delays(crashes: int, ran_s: float = 1.0, policy: RestartBackOff = KUBELET) -> list[float]:
    delays, backoff = [], None
    for _ in range(crashes):
        delay, backoff = policy.after_exit(backoff, ran_s)
        delays.append(delay)
    return delays


def test_first_restart_is_immediate_then_the_delay_doubles_from_10_s_up_to_5_minutes():
    assert _delays(10) == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0, 300.0]


def test_a_process_that_ran_over_10_minutes_starts_its_back_off_over():
    delay, backoff = 0.0, None
    for _ in range(7):
        delay, backoff = KUBELET.after_exit(backoff, 5.0)
    assert (delay, backoff) == (300.0, 300.0)
    assert KUBELET.after_exit(backoff, 599.0) == (300.0, 300.0)  # 10 minutes not reached
    assert KUBELET.after_exit(backoff, 601.0) == (0.0, 10.0)  # restarted at once; next crash 10 s
    assert KUBELET.after_exit(10.0, 3.0) == (10.0, 20.0)


def test_the_waiting_message_is_the_kubelets():
    assert (
        crash_loop_message(20.0, "server", "rm-0", "ml", "1234-abcd")
        == "back-off 20s restarting failed container=server pod=rm-0_ml(1234-abcd)"
    )


def test_the_cause_is_the_logs_last_80_lines_and_2048_bytes():
    log = "".join(f"line {i}\n" for i in range(200)) + "RuntimeError: out of memory\n"
    message = fallback_termination_message(log)
    assert message.endswith("RuntimeError: out of memory\n")
    assert message.splitlines()[0] == "line 121" and len(message.splitlines()) == 80
    long = fallback_termination_message("x" * 5000 + "\nthe cause\n")
    assert len(long.encode()) == 2048 and long.endswith("the cause\n")
    # a cut inside a multi-byte character drops the partial character, nothing else
    assert fallback_termination_message("é" * 2000).startswith("é")
