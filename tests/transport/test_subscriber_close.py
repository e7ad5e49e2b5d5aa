"""A weight subscriber closes at once, even while it backs off between reconnects (as every
worker's does once the learner, its publisher, has exited at the end of a run)."""
import socket
import time

from pipelinerl_jax.transport.retry import RetryPolicy
from tests.transport.flat_weights import FlatSubscriber as WeightSubscriber


def _dead_address() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_close_interrupts_the_reconnect_backoff():
    # The backoff outlasts close's own timeout: a close that did not interrupt it would
    # return with the thread still alive.
    sub = WeightSubscriber(_dead_address(), lambda *a: None,
                           retry=RetryPolicy(initial_s=3600.0, max_s=3600.0))
    deadline = time.time() + 10
    while sub.reconnects == 0:  # the first attempt failed: now in a long backoff
        assert time.time() < deadline
        time.sleep(0.01)
    sub.close(timeout=60.0)
    assert not sub._thread.is_alive()
