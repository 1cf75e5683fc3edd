"""Type stubs of ``pdd_transport._native``'s radix prefix cache and routing policies
(rust/pdd-py/src/radix.rs, policy.rs); ``_native.pyi`` re-exports them. A stub module
only: there is no ``pdd_transport._native_policy`` at run time."""

from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias, final

import numpy as np
import numpy.typing as npt

_Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.uint32] | npt.NDArray[np.int32] | npt.NDArray[np.int64]

@final
class RadixNode:
    """Opaque reference to the node ending a cached prefix."""

    @property
    def namespace(self) -> int: ...
    @property
    def is_root(self) -> bool: ...

@final
class RadixMatch:
    """What a match found."""

    @property
    def matched_tokens(self) -> int: ...
    @property
    def handles(self) -> npt.NDArray[np.uint32]: ...
    @property
    def node(self) -> RadixNode: ...
    @property
    def prefix_hash(self) -> int: ...

@final
class RadixInsert:
    """What an insert did."""

    @property
    def cached_tokens(self) -> int: ...
    @property
    def duplicates(self) -> npt.NDArray[np.uint32]: ...
    @property
    def node(self) -> RadixNode: ...

@final
class RadixCache:
    """Page-granular radix tree of cached token prefixes."""

    def __new__(cls, page_size: int = 64) -> RadixCache: ...
    @property
    def page_size(self) -> int: ...
    def match_prefix(self, tokens: _Tokens, namespace: int = 0) -> RadixMatch: ...
    def match_from(self, node: RadixNode, tokens: _Tokens) -> RadixMatch: ...
    def peek_prefix(self, tokens: _Tokens, namespace: int = 0) -> int: ...
    def insert(self, tokens: _Tokens, handles: _Tokens, namespace: int = 0) -> RadixInsert: ...
    def insert_from(self, node: RadixNode, tokens: _Tokens, handles: _Tokens) -> RadixInsert: ...
    def match_batch(self, flat_tokens: _Tokens, offsets: _Tokens, namespace: int = 0) -> list[RadixMatch]: ...
    def insert_batch(
        self,
        flat_tokens: _Tokens,
        offsets: _Tokens,
        flat_handles: _Tokens,
        handle_offsets: _Tokens,
        namespace: int = 0,
    ) -> list[RadixInsert]: ...
    def lock(self, node: RadixNode) -> None: ...
    def unlock(self, node: RadixNode) -> None: ...
    def evict(self, n_pages: int) -> npt.NDArray[np.uint32]: ...
    def clear(self) -> npt.NDArray[np.uint32]: ...
    def stats(self) -> dict[str, int]: ...
    def drain_event_frames(self, source_id: int) -> list[bytes]: ...
    def snapshot_frames(self, source_id: int) -> tuple[int, list[bytes]]: ...

@final
class PrefixMirror:
    """Membership index of what each decode instance caches."""

    def __new__(cls, page_size: int = 64) -> PrefixMirror: ...
    def apply_frame(self, frame: bytes) -> int: ...
    def resync(self, instance: int, last_event_id: int, frames: Sequence[bytes]) -> None: ...
    def remove_instance(self, instance: int) -> bool: ...
    def instances(self) -> list[int]: ...
    def last_event_id(self, instance: int) -> int | None: ...
    def match_prefix(self, tokens: _Tokens, namespace: int = 0) -> dict[int, int]: ...

def chain_hashes(tokens: _Tokens, page_size: int, namespace: int = 0) -> npt.NDArray[np.uint64]:
    """Chain hashes of every whole page of ``tokens``."""

# ---- policies (rust/pdd-py/src/policy.rs) ----

@final
class WanEstimate:
    """The router's estimate of the WAN path from Prefill to MainDecode."""

    def __new__(cls, goodput_gbit: float, rtt_ms: float) -> WanEstimate: ...
    @property
    def goodput_gbit(self) -> float: ...
    @property
    def rtt_ms(self) -> float: ...

@final
class PipelinePolicy:
    """Tunables of the pipeline choice (P-MD or P-RLD-MD); ``None`` keeps a default."""

    def __new__(
        cls,
        *,
        ttft_budget_ms: float | None = None,
        setup_rtts: float | None = None,
        goodput_share: float | None = None,
    ) -> PipelinePolicy: ...
    @property
    def ttft_budget_ms(self) -> float: ...
    @property
    def setup_rtts(self) -> float: ...
    @property
    def goodput_share(self) -> float: ...

@final
class AnomalyPolicy:
    """Tunables of the anomaly filter; ``None`` keeps a default."""

    def __new__(
        cls,
        *,
        long_input_tokens: int | None = None,
        low_hit_rate: float | None = None,
        short_output_tokens: int | None = None,
    ) -> AnomalyPolicy: ...
    @staticmethod
    def disabled() -> AnomalyPolicy: ...
    @property
    def long_input_tokens(self) -> int: ...
    @property
    def low_hit_rate(self) -> float: ...
    @property
    def short_output_tokens(self) -> int: ...

@final
class RouteDecision:
    """What ``route`` decided."""

    @property
    def pipeline(self) -> str: ...
    @property
    def anomaly(self) -> bool: ...
    @property
    def missing_tokens(self) -> int: ...
    @property
    def kv_arrival_ms(self) -> float: ...
    @property
    def sends_kv_over_wan(self) -> bool: ...
    @property
    def uses_rld(self) -> bool: ...

class _HandoffPolicyLike(Protocol):
    @property
    def catch_up_threshold_tokens(self) -> int: ...
    @property
    def level_tokens(self) -> int: ...
    @property
    def chunk_tokens(self) -> int: ...
    @property
    def one_shot_load(self) -> float: ...
    @property
    def max_eager_tokens(self) -> int: ...

def kv_arrival_ms(policy: PipelinePolicy, wan: WanEstimate, missing_bytes: int) -> float:
    """Estimated milliseconds for ``missing_bytes`` of KV to reach MainDecode."""

def choose_pipeline(
    policy: PipelinePolicy, wan: WanEstimate, prompt_tokens: int, md_cached_tokens: int, kv_bytes_per_token: int
) -> str:
    """``"p_md"`` or ``"p_rld_md"`` (never ``"p_rld"``)."""

def is_anomaly(
    policy: AnomalyPolicy, prompt_tokens: int, md_cached_tokens: int, expected_output_tokens: int | None
) -> bool:
    """The anomaly filter."""

def route(
    wan: WanEstimate,
    prompt_tokens: int,
    md_cached_tokens: int,
    kv_bytes_per_token: int,
    expected_output_tokens: int | None = None,
    *,
    pipeline_policy: PipelinePolicy | None = None,
    anomaly_policy: AnomalyPolicy | None = None,
) -> RouteDecision:
    """The anomaly filter, then the pipeline choice."""

def choose_handoff_mode(policy: _HandoffPolicyLike | None, rld_load: float, backlog_tokens: int) -> str:
    """``pdd_core::handoff::choose_mode``: ``"one_shot"`` or ``"catch_up"``."""

def catch_up_step(policy: _HandoffPolicyLike | None, backlog_tokens: int) -> tuple[str, int]:
    """``("chunk", n)`` or ``("final", backlog_tokens)``."""

def check_handoff_policy(policy: _HandoffPolicyLike) -> None:
    """``HandoffPolicy::validate`` on any object with the five attributes."""

def default_handoff_policy() -> dict[str, Any]:
    """``HandoffPolicy::default()`` as a dict."""
