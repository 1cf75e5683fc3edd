"""What the README's "Errors" section promises: a bad value is a PddError with a reason
(and the matching built-in); a wrong Python type is the built-in TypeError from the
extension's calls, and InvalidArgument from the pure-Python checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pdd_transport import HandoffPair, HandoffTimers, InvalidArgument, PddError, wire
from pdd_transport.radix import RadixCache
from pdd_transport.wanem import Wanem

BAD_VALUES: list[Callable[[], Any]] = [
    lambda: RadixCache(page_size=0),
    lambda: HandoffTimers(max_attempts=-1),
    lambda: HandoffPair().relay.open(2**64, 10),
    lambda: wire.decode_frame(b"\x00" * 8),
    lambda: Wanem("127.0.0.1:1", rtt_ms=-30),
]

WRONG_TYPES_IN_THE_EXTENSION: list[Callable[[], Any]] = [
    lambda: RadixCache(page_size="64"),  # type: ignore[arg-type]
    lambda: HandoffPair().relay.open("1", 10),  # type: ignore[arg-type]
    lambda: wire.encode_handoff(1, 0, 0, np.zeros(3, dtype=np.float32)),
]

def _sender(**kwargs: Any) -> Any:
    from pdd_transport import kv

    pool = kv.pool_from_buffers([np.zeros(4096, dtype=np.uint8)], 4096)
    return kv.KvSender(pool, "127.0.0.1:1", connect_timeout_s=0.2, **kwargs)


# Checked before anything connects (port 1 would refuse, a TransportError).
OUT_OF_RANGE_UNSIGNED: list[Callable[[], Any]] = [
    lambda: _sender(unsent_limit=-1),
    lambda: _sender(socket_buffer=-1),
    lambda: _sender(lanes=2**16),
]

WRONG_TYPES_IN_PYTHON: list[Callable[[], Any]] = [
    lambda: Wanem("127.0.0.1:1", rtt_ms="30"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("call", BAD_VALUES)
def test_a_bad_value_is_a_pdd_error_with_a_reason(call: Callable[[], Any]) -> None:
    with pytest.raises(PddError) as exc:
        call()
    assert isinstance(exc.value.reason, str) and exc.value.reason
    assert isinstance(exc.value, (ValueError, ConnectionError, TimeoutError))


@pytest.mark.parametrize("call", WRONG_TYPES_IN_THE_EXTENSION)
def test_a_wrong_type_into_the_extension_is_a_type_error(call: Callable[[], Any]) -> None:
    with pytest.raises(TypeError):
        call()


@pytest.mark.parametrize("call", WRONG_TYPES_IN_PYTHON)
def test_a_wrong_type_in_a_python_check_is_invalid_argument(call: Callable[[], Any]) -> None:
    with pytest.raises(InvalidArgument):
        call()


@pytest.mark.parametrize("call", OUT_OF_RANGE_UNSIGNED)
def test_an_int_outside_an_unsigned_count_is_an_overflow_error(call: Callable[[], Any]) -> None:
    with pytest.raises(OverflowError):
        call()
