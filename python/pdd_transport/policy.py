"""Routing and handoff policies: pure functions over tunables, computed in Rust.

Where a request goes (``docs/policies.md``)::

    from pdd_transport import policy

    wan = policy.WanEstimate(goodput_gbit=10, rtt_ms=30)
    d = policy.route(wan, prompt_tokens=65_536, md_cached_tokens=62_000,
                     kv_bytes_per_token=50_000, expected_output_tokens=300)
    d.pipeline          # "p_md": the missing KV arrives within the TTFT budget
    d.kv_arrival_ms     # the estimate behind it

- :func:`choose_pipeline`: ``"p_md"`` when MainDecode's missing KV would cross the WAN
  within :attr:`PipelinePolicy.ttft_budget_ms`, else ``"p_rld_md"``. Never
  ``"p_rld"``: finishing requests on RelayDecode as a general path starves MD's cache
  and overloads RLD.
- :func:`is_anomaly`: long input, low MD hit rate and short expected output: finish it
  on RLD and cancel its WAN transfer.
- :func:`route`: the filter first, then the pipeline choice.
- :func:`choose_handoff_mode` and :func:`catch_up_step`: the handoff-mode policy of
  the handoff machines (``pdd_core::handoff::choose_mode``), on a
  :class:`HandoffPolicy` or any object with the same five attributes.

Every tunable is checked when the policy is built; a bad one, or a bad count, raises
:class:`~pdd_transport.errors.InvalidArgument`.
"""

from __future__ import annotations

from typing import Literal, Protocol, cast

from pdd_transport import _native
from pdd_transport._native import (
    AnomalyPolicy,
    PipelinePolicy,
    RouteDecision,
    WanEstimate,
    choose_pipeline,
    is_anomaly,
    kv_arrival_ms,
    route,
)

__all__ = [
    "AnomalyPolicy",
    "HandoffMode",
    "HandoffPolicy",
    "HandoffTunables",
    "Pipeline",
    "PipelinePolicy",
    "RouteDecision",
    "WanEstimate",
    "catch_up_step",
    "choose_handoff_mode",
    "choose_pipeline",
    "is_anomaly",
    "kv_arrival_ms",
    "route",
]

Pipeline = Literal["p_md", "p_rld_md", "p_rld"]
"""The names :func:`choose_pipeline` and :func:`route` return."""

HandoffMode = Literal["one_shot", "catch_up"]
"""The names :func:`choose_handoff_mode` returns."""


class HandoffTunables(Protocol):
    """What the handoff functions read from a policy: the five tunables of the Rust
    ``HandoffPolicy``. :class:`HandoffPolicy` has them; so may other bindings."""

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


# The handoff policy is the one class the handoff links take (``RelayLink.connect(
# policy=...)``), bound natively in ``rust/pdd-py/src/handoff.rs`` and validated by
# the Rust ``HandoffPolicy::validate`` when built.
HandoffPolicy = _native.HandoffPolicy


def choose_handoff_mode(policy: HandoffTunables | None, rld_load: float, backlog_tokens: int) -> HandoffMode:
    """One-Shot or Catch-Up for a request whose MainDecode KV just became complete.

    ``rld_load``: RLD utilisation, 0 idle to 1 saturated (NaN counts as saturated);
    ``backlog_tokens``: eager tokens not yet handed. ``policy``: a
    :class:`HandoffPolicy`, any object with its five attributes (checked on each
    call), or ``None`` for the defaults.
    """
    return cast(HandoffMode, _native.choose_handoff_mode(policy, rld_load, backlog_tokens))


def catch_up_step(policy: HandoffTunables | None, backlog_tokens: int) -> tuple[Literal["chunk", "final"], int]:
    """The next Catch-Up step once MainDecode caught up: ``("chunk", n)`` hands the
    oldest ``n`` tokens and keeps decoding; ``("final", backlog_tokens)`` hands the
    rest with the final flag and stops."""
    kind, n = _native.catch_up_step(policy, backlog_tokens)
    return cast(Literal["chunk", "final"], kind), n
