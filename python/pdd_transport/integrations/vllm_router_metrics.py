"""The PDD router's own Prometheus metrics (``GET /metrics``), in the text exposition
format 0.0.4, written here: the router runs in the project's environment, which does
not carry ``prometheus_client`` (an optional extra). Series (docs/vllm.md, "Running a
fleet"):

- ``pdd_router_requests_total{pipeline}``: sub-requests (one choice) routed per pipeline;
- ``pdd_router_ttft_seconds{pipeline}``: histogram, sub-request start -> first token given;
- ``pdd_router_handoffs_total{mode}``: token-ID handoffs by mode (one_shot, catch_up);
- ``pdd_router_md_choices_total{instance,reason}``: MainDecode choices (prefix, no_hit,
  round_robin); ``pdd_router_instance_requests_total{role,instance}``: every role;
- ``pdd_router_md_prompt_tokens_total`` and ``pdd_router_md_held_tokens_total``: the
  prompt tokens routed to MDs and the part the chosen MD held by the router's view;
  ``pdd_router_md_prefix_hit_ratio`` is their quotient;
- ``pdd_router_wan_kv_bytes_estimated_total{instance}``: KV bytes the router expects P
  to send each MD (whole prompt blocks the view says MD lacks x ``kv_bytes_per_token``):
  an estimate; the bytes sent are on P's own ``/metrics`` (``vllm:pdd_kv_bytes_total``);
- ``pdd_router_instance_up{role,instance}``, ``pdd_router_instance_in_flight{...}``,
  ``pdd_router_instance_transitions_total{role,instance,to}``;
- ``pdd_router_errors_total{code}``: sub-requests that ended in an error, by HTTP status;
  ``pdd_router_recoveries_total{finisher}``: P-RLD-MD requests one decoder finished for
  the other;
- ``pdd_router_md_view_corrections_total{instance}`` (shadow view) and
  ``pdd_router_md_events_total{instance,kind}`` (event-fed view: messages, malformed, gaps).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdd_transport.integrations.vllm_pipelines import PipelineRunner, SubResult

__all__ = ["CONTENT_TYPE", "Family", "RouterMetrics", "TTFT_BUCKETS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v)) if v != int(v) else str(int(v))


class Family:
    """One metric family: ``counter``, ``gauge`` or ``histogram``, its samples by label values."""

    def __init__(self, name: str, kind: str, help_text: str, labels: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = TTFT_BUCKETS):
        self.name, self.kind, self.help, self.labels, self.buckets = name, kind, help_text, labels, buckets
        self.values: dict[tuple[str, ...], float] = {}
        self.hist: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels {sorted(labels)}, expected {sorted(self.labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0 and self.kind == "counter":
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)

    def observe(self, value: float, **labels: str) -> None:
        counts, total = self.hist.setdefault(self._key(labels), ([0] * (len(self.buckets) + 1), [0.0]))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        total[0] += value

    def _labels(self, key: tuple[str, ...], extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = list(zip(self.labels, key)) + list(extra)
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""

    def render(self) -> list[str]:
        # HELP escapes backslash and newline; label values also the double quote.
        help_text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines = [f"# HELP {self.name} {help_text}", f"# TYPE {self.name} {self.kind}"]
        if self.kind == "histogram":
            for key, (counts, total) in sorted(self.hist.items()):
                for bound, n in zip((*self.buckets, math.inf), counts):
                    lines.append(f"{self.name}_bucket{self._labels(key, (('le', _number(bound)),))} {n}")
                lines.append(f"{self.name}_sum{self._labels(key)} {_number(total[0])}")
                lines.append(f"{self.name}_count{self._labels(key)} {counts[-1]}")
        else:
            for key, value in sorted(self.values.items()):
                lines.append(f"{self.name}{self._labels(key)} {_number(value)}")
        return lines


class RouterMetrics:
    """What the router counts per sub-request (:meth:`observe`) and reads from its
    fleet at each scrape (:meth:`render`)."""

    def __init__(self) -> None:
        f = Family
        self.requests = f("pdd_router_requests_total", "counter", "Sub-requests routed, by pipeline", ("pipeline",))
        self.ttft = f("pdd_router_ttft_seconds", "histogram", "Sub-request start to its first token, by pipeline",
                      ("pipeline",))
        self.handoffs = f("pdd_router_handoffs_total", "counter", "Token-ID handoffs, by mode", ("mode",))
        self.md_choices = f("pdd_router_md_choices_total", "counter", "MainDecode choices, by instance and reason",
                            ("instance", "reason"))
        self.instance_requests = f("pdd_router_instance_requests_total", "counter",
                                   "Sub-requests sent to each instance", ("role", "instance"))
        self.md_prompt = f("pdd_router_md_prompt_tokens_total", "counter", "Prompt tokens routed to MainDecodes")
        self.md_held = f("pdd_router_md_held_tokens_total", "counter",
                         "Prompt tokens the chosen MainDecode held, by the router's view")
        self.wan = f("pdd_router_wan_kv_bytes_estimated_total", "counter",
                     "KV bytes P is expected to send each MainDecode (the router's estimate)", ("instance",))
        self.errors = f("pdd_router_errors_total", "counter", "Sub-requests that ended in an error, by HTTP status",
                        ("code",))

    def observe(self, runner: PipelineRunner, sub: SubResult) -> None:
        c = runner.config
        if sub.error is not None:
            self.errors.inc(code=str(sub.error.to_api().status))
        if sub.route is None:
            return
        r = sub.route
        self.requests.inc(pipeline=sub.pipeline)
        if sub.ttft_s is not None and sub.error is None:
            self.ttft.observe(sub.ttft_s, pipeline=sub.pipeline)
        if sub.handoff_mode in ("one_shot", "catch_up") and sub.handoffs:
            self.handoffs.inc(mode=sub.handoff_mode)
        if r.prefill is not None:
            self.instance_requests.inc(role="prefill", instance=r.prefill.name)
        if r.relay is not None:
            self.instance_requests.inc(role="relay_decode", instance=r.relay.name)
        if sub.pipeline != "p_rld":  # P-RLD never reaches MD
            self.instance_requests.inc(role="main_decode", instance=r.main.name)
            self.md_choices.inc(instance=r.main.name, reason=r.md_reason)
            self.md_prompt.inc(len(sub.prompt))
            self.md_held.inc(sub.md_held_tokens)
            whole = (len(sub.prompt) - 1) // c.main_block_size * c.main_block_size
            self.wan.inc(max(0, whole - sub.md_held_tokens) * c.kv_bytes_per_token, instance=r.main.name)

    def render(self, runner: PipelineRunner) -> str:
        f = Family
        up = f("pdd_router_instance_up", "gauge", "1 while the instance takes requests", ("role", "instance", "url"))
        flight = f("pdd_router_instance_in_flight", "gauge", "Requests in flight on the instance", ("role", "instance"))
        moves = f("pdd_router_instance_transitions_total", "counter", "Health transitions, by direction",
                  ("role", "instance", "to"))
        for role, insts in runner.fleet.instances.items():
            for i in insts:
                up.set(1.0 if i.up else 0.0, role=role, instance=i.name, url=i.url)
                flight.set(i.in_flight, role=role, instance=i.name)
                for to, n in i.transitions.items():
                    moves.set(n, role=role, instance=i.name, to=to)
        held, prompt = self.md_held.values.get((), 0.0), self.md_prompt.values.get((), 0.0)
        ratio = f("pdd_router_md_prefix_hit_ratio", "gauge", "Held over routed prompt tokens of the MainDecode choice")
        ratio.set(held / prompt if prompt else 0.0)
        recoveries = f("pdd_router_recoveries_total", "counter", "P-RLD-MD requests one decoder finished for the other",
                       ("finisher",))
        for who in ("rld", "md"):
            recoveries.set(runner.counters.get(f"{who}_recoveries", 0), finisher=who)
        corrections = f("pdd_router_md_view_corrections_total", "counter",
                        "Times an MD reported less cached than the router's view held", ("instance",))
        events = f("pdd_router_md_events_total", "counter", "KV cache event messages per MainDecode, by outcome",
                   ("instance", "kind"))
        for inst, view in zip(runner.fleet.instances["main_decode"], runner.md_views):
            corrections.set(view.corrections, instance=inst.name)
            stats: Any = getattr(view, "stats", None)
            if isinstance(stats, dict):
                for kind in ("messages", "malformed", "gaps"):
                    events.set(stats.get(kind, 0), instance=inst.name, kind=kind)
        families = [self.requests, self.ttft, self.handoffs, self.md_choices, self.instance_requests, self.md_prompt,
                    self.md_held, ratio, self.wan, up, flight, moves, self.errors, recoveries, corrections, events]
        return "\n".join(line for fam in families for line in fam.render()) + "\n"
