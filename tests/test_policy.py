"""The routing and handoff policies from Python (pdd_transport.policy): the rules, the
defaults documented in docs/policies.md, typed refusals, and monotonicity sweeps."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pdd_transport
import pytest
from pdd_transport import InvalidArgument, _native, policy
from pdd_transport.policy import (
    AnomalyPolicy,
    HandoffPolicy,
    PipelinePolicy,
    WanEstimate,
    catch_up_step,
    choose_handoff_mode,
    choose_pipeline,
    is_anomaly,
    kv_arrival_ms,
    route,
)

KVB = 50_000  # bytes of KV per token, pdd-system.md's typical figure
WAN = WanEstimate(goodput_gbit=10, rtt_ms=30)


def test_defaults_are_the_documented_ones() -> None:
    p, a = PipelinePolicy(), AnomalyPolicy()
    assert (p.ttft_budget_ms, p.setup_rtts, p.goodput_share) == (500.0, 1.5, 0.8)
    assert (a.long_input_tokens, a.low_hit_rate, a.short_output_tokens) == (32_768, 0.2, 64)
    # The Python HandoffPolicy mirrors the Rust defaults exactly.
    h = HandoffPolicy()
    assert _native.default_handoff_policy() == {
        "catch_up_threshold_tokens": h.catch_up_threshold_tokens,
        "level_tokens": h.level_tokens,
        "chunk_tokens": h.chunk_tokens,
        "one_shot_load": h.one_shot_load,
        "max_eager_tokens": h.max_eager_tokens,
    }
    assert repr(p) == "PipelinePolicy(ttft_budget_ms=500, setup_rtts=1.5, goodput_share=0.8)"


def test_arrival_estimate() -> None:
    p = PipelinePolicy(ttft_budget_ms=100, setup_rtts=2, goodput_share=1)
    wan = WanEstimate(8, 10)  # 1e6 bytes per ms
    assert kv_arrival_ms(p, wan, 0) == 20.0
    assert kv_arrival_ms(p, wan, 5_000_000) == 25.0
    assert (wan.goodput_gbit, wan.rtt_ms) == (8.0, 10.0)


def test_pipeline_choice() -> None:
    p = PipelinePolicy()
    assert choose_pipeline(p, WAN, 65_536, 62_259, KVB) == "p_md"  # 95% hit
    assert choose_pipeline(p, WAN, 65_536, 32_768, KVB) == "p_rld_md"  # 50% hit
    assert choose_pipeline(p, WAN, 65_536, 65_536, KVB) == "p_md"  # full hit
    tight = PipelinePolicy(ttft_budget_ms=10)  # below the handshake: always RLD
    assert choose_pipeline(tight, WAN, 100, 100, KVB) == "p_rld_md"


def test_anomaly_filter() -> None:
    a = AnomalyPolicy()
    assert is_anomaly(a, 100_000, 5_000, 20)
    assert not is_anomaly(a, 20_000, 1_000, 20)  # short input
    assert not is_anomaly(a, 100_000, 50_000, 20)  # hit 50%
    assert not is_anomaly(a, 100_000, 5_000, 500)  # long output
    assert not is_anomaly(a, 100_000, 5_000, None)  # unknown output: never an anomaly
    assert not is_anomaly(AnomalyPolicy.disabled(), 10**12, 0, 0)


def test_route_filters_first_then_chooses() -> None:
    d = route(WAN, 100_000, 5_000, KVB, 20)
    assert (d.pipeline, d.anomaly, d.missing_tokens) == ("p_rld", True, 95_000)
    assert not d.sends_kv_over_wan and d.uses_rld
    assert d.kv_arrival_ms == kv_arrival_ms(PipelinePolicy(), WAN, 95_000 * KVB)
    d = route(WAN, 100_000, 5_000, KVB, 2_000)
    assert (d.pipeline, d.anomaly) == ("p_rld_md", False)
    assert d.sends_kv_over_wan and d.uses_rld
    d = route(WAN, 100_000, 99_000, KVB)
    assert (d.pipeline, d.anomaly) == ("p_md", False)
    assert d.sends_kv_over_wan and not d.uses_rld
    assert repr(d).startswith('RouteDecision(pipeline="p_md", anomaly=False, missing_tokens=1000')
    # The filter can be tuned or switched off per call.
    d = route(WAN, 100_000, 5_000, KVB, 20, anomaly_policy=AnomalyPolicy.disabled())
    assert d.pipeline == "p_rld_md"
    d = route(WAN, 100_000, 5_000, KVB, 20, pipeline_policy=PipelinePolicy(ttft_budget_ms=1e9),
              anomaly_policy=AnomalyPolicy.disabled())
    assert d.pipeline == "p_md"


@pytest.mark.parametrize(
    "build",
    [
        lambda: WanEstimate(0, 10),
        lambda: WanEstimate(-1, 10),
        lambda: WanEstimate(math.nan, 10),
        lambda: WanEstimate(math.inf, 10),
        lambda: WanEstimate(10, -1),
        lambda: WanEstimate("fast", 10),  # type: ignore[arg-type]
        lambda: PipelinePolicy(ttft_budget_ms=-1),
        lambda: PipelinePolicy(ttft_budget_ms=math.nan),
        lambda: PipelinePolicy(setup_rtts=-0.5),
        lambda: PipelinePolicy(goodput_share=0),
        lambda: PipelinePolicy(goodput_share=1.5),
        lambda: AnomalyPolicy(low_hit_rate=1.1),
        lambda: AnomalyPolicy(low_hit_rate=math.nan),
        lambda: AnomalyPolicy(long_input_tokens=-1),
        lambda: AnomalyPolicy(short_output_tokens=1.5),  # type: ignore[arg-type]
        lambda: HandoffPolicy(level_tokens=64),
        lambda: HandoffPolicy(chunk_tokens=0),
        lambda: HandoffPolicy(one_shot_load=1.2),
        lambda: HandoffPolicy(max_eager_tokens=0),
        lambda: HandoffPolicy(max_eager_tokens=16_001),
        lambda: HandoffPolicy(level_tokens=-1),
        lambda: choose_pipeline(PipelinePolicy(), WAN, 10, 11, KVB),  # more cached than the prompt
        lambda: choose_pipeline(PipelinePolicy(), WAN, -1, 0, KVB),
        lambda: is_anomaly(AnomalyPolicy(), 10, 0, -5),
        lambda: route(WAN, 10, 11, KVB),
        lambda: kv_arrival_ms(PipelinePolicy(), WAN, -1),
        lambda: choose_handoff_mode(None, 0.5, -1),
        lambda: choose_handoff_mode(SimpleNamespace(level_tokens=1), 0.5, 10),  # type: ignore[arg-type]
        lambda: catch_up_step(None, 2**32),
    ],
)
def test_bad_tunables_and_inputs_raise_invalid_argument(build: object) -> None:
    assert callable(build)
    with pytest.raises(InvalidArgument) as e:
        build()
    assert e.value.reason == "invalid_argument"
    assert isinstance(e.value, ValueError)


def test_handoff_mode_is_the_core_policy() -> None:
    h = HandoffPolicy()
    assert choose_handoff_mode(h, 0.1, 65) == "catch_up"  # backlog above the threshold
    assert choose_handoff_mode(h, 0.1, 64) == "one_shot"  # at the threshold
    assert choose_handoff_mode(h, 0.85, 1000) == "one_shot"  # a busy RLD frees its slot
    assert choose_handoff_mode(h, math.nan, 1000) == "one_shot"  # unknown load = saturated
    assert choose_handoff_mode(None, 0.1, 65) == "catch_up"  # None: the defaults
    assert catch_up_step(h, 1000) == ("chunk", 256)
    assert catch_up_step(h, 100) == ("chunk", 100)
    assert catch_up_step(h, 8) == ("final", 8)
    # Any object with the five attributes will do (another binding of the tunables).
    other = SimpleNamespace(
        catch_up_threshold_tokens=10, level_tokens=2, chunk_tokens=4, one_shot_load=0.5, max_eager_tokens=100
    )
    assert choose_handoff_mode(other, 0.4, 11) == "catch_up"  # type: ignore[arg-type]
    assert choose_handoff_mode(other, 0.5, 11) == "one_shot"  # type: ignore[arg-type]
    assert catch_up_step(other, 11) == ("chunk", 4)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        h.level_tokens = 3  # type: ignore[misc]  # frozen


def test_pipeline_monotone_in_missing_tokens_wan_and_budget() -> None:
    budgets = [0, 50, 200, 500, 2000]
    wans = [WanEstimate(g, r) for g, r in itertools.product([0.5, 5, 25, 100], [0, 10, 60, 200])]
    prompts = [0, 1_000, 16_384, 65_536, 131_072]
    hits = [0.0, 0.2, 0.5, 0.9, 0.95, 0.99, 1.0]
    order = {"p_md": 0, "p_rld_md": 1}
    for b in budgets:
        p = PipelinePolicy(ttft_budget_ms=b)
        for wan in wans:
            for prompt in prompts:
                # Fewer cached tokens (more missing) never go back from p_rld_md to p_md.
                choices = [order[choose_pipeline(p, wan, prompt, int(prompt * h), KVB)] for h in reversed(hits)]
                assert choices == sorted(choices), (b, wan, prompt)
    # A better WAN or a larger budget never move a request from p_md to p_rld_md.
    for prompt, h in itertools.product(prompts, hits):
        cached = int(prompt * h)
        by_goodput = [order[choose_pipeline(PipelinePolicy(), WanEstimate(g, 30), prompt, cached, KVB)]
                      for g in [0.5, 1, 5, 10, 50, 400]]
        assert by_goodput == sorted(by_goodput, reverse=True)
        by_budget = [order[choose_pipeline(PipelinePolicy(ttft_budget_ms=b), WAN, prompt, cached, KVB)]
                     for b in budgets]
        assert by_budget == sorted(by_budget, reverse=True)


def test_anomaly_monotone_in_hit_rate_and_output() -> None:
    a = AnomalyPolicy()
    for prompt in [1_000, 32_768, 32_769, 100_000]:
        for out in [None, 0, 10, 63, 64, 500]:
            flags = [is_anomaly(a, prompt, int(prompt * h / 100), out) for h in range(0, 101, 5)]
            # Once a higher hit rate clears the filter, it stays cleared.
            assert flags == sorted(flags, reverse=True), (prompt, out)
        flags = [is_anomaly(a, prompt, prompt // 20, out) for out in range(0, 200, 7)]
        assert flags == sorted(flags, reverse=True)


def test_exports() -> None:
    assert pdd_transport.policy is policy
    for name in policy.__all__:
        assert hasattr(policy, name)
    # The native module's __all__ lists the policy names together, in registration order.
    names = ["WanEstimate", "PipelinePolicy", "AnomalyPolicy", "RouteDecision", "kv_arrival_ms",
             "choose_pipeline", "is_anomaly", "route", "choose_handoff_mode", "catch_up_step",
             "check_handoff_policy", "default_handoff_policy"]
    exported = list(_native.__all__)
    start = exported.index(names[0])
    assert exported[start : start + len(names)] == names



DOC = (Path(__file__).parent.parent / "docs" / "policies.md").read_text()


def _rows_after(marker: str) -> list[list[str]]:
    rows: list[list[str]] = []
    for line in DOC[DOC.index(marker):].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", " "} or cells[0] in {"Tunable", "MD hit"}:
            continue
        rows.append(cells)
    return rows


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.mark.parametrize(
    ("marker", "policy_obj"),
    [("### Tunables (`PipelinePolicy`)", PipelinePolicy()), ("### Tunables (`AnomalyPolicy`)", AnomalyPolicy())],
)
def test_documented_defaults_are_the_code_defaults(marker: str, policy_obj: object) -> None:
    rows = _rows_after(marker)
    assert len(rows) == 3
    for name, default, _why in rows:
        assert getattr(policy_obj, name.strip("`")) == _number(default), name


def test_documented_example_table_is_what_route_says() -> None:
    rows = _rows_after("### What the defaults do")
    assert len(rows) == 7
    for hit, missing, arrival, pipeline in rows:
        prompt = 65_536
        cached = int(prompt * _number(hit.rstrip("%")) / 100)
        d = route(WAN, prompt, cached, KVB)
        assert d.missing_tokens == _number(missing)
        assert round(d.kv_arrival_ms) == _number(arrival)
        assert d.pipeline == {"P-MD": "p_md", "P-RLD-MD": "p_rld_md"}[pipeline]
