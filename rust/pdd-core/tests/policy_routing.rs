//! The routing policies (`pdd_core::policy`): unit tests of each rule and its
//! validation, and property tests of the monotonicity the router relies on.

use pdd_core::policy::*;
use pdd_core::{Error, ErrorClass};
use proptest::prelude::*;

const KVB: u64 = 50_000; // 50 KB per token, pdd-system.md's typical figure

fn req(prompt: u64, cached: u64, output: Option<u64>) -> RequestShape {
    RequestShape {
        prompt_tokens: prompt,
        md_cached_tokens: cached,
        kv_bytes_per_token: KVB,
        expected_output_tokens: output,
    }
}

fn wan(gbit: f64, rtt_ms: f64) -> WanEstimate {
    WanEstimate::new(gbit, rtt_ms).unwrap()
}

fn is_invalid(r: Result<impl std::fmt::Debug, Error>) -> bool {
    matches!(&r, Err(e) if e.class() == ErrorClass::InvalidArgument && e.reason() == "invalid_argument")
}

// ---- pipeline choice ----

#[test]
fn high_hit_goes_p_md_low_hit_goes_p_rld_md() {
    let p = PipelinePolicy::default();
    let w = wan(10.0, 30.0);
    // 64K prompt, 95% hit: 3,277 missing tokens = 164 MB, ~209 ms at 8 Gbit/s + 45 ms.
    assert_eq!(
        choose_pipeline(&p, &w, &req(65_536, 62_259, None)),
        Pipeline::PMd
    );
    // 64K prompt, 50% hit: 1.6 GB, about 2 s: RLD masks it.
    assert_eq!(
        choose_pipeline(&p, &w, &req(65_536, 32_768, None)),
        Pipeline::PRldMd
    );
    // Full hit: only the handshake, well within the budget.
    assert_eq!(
        choose_pipeline(&p, &w, &req(65_536, 65_536, None)),
        Pipeline::PMd
    );
}

#[test]
fn the_budget_boundary_is_inclusive() {
    let p = PipelinePolicy {
        ttft_budget_ms: 100.0,
        setup_rtts: 1.0,
        goodput_share: 1.0,
    };
    // 8 Gbit/s = 1e6 bytes per ms; RTT 20 ms; 80 ms of bytes = 8e7 bytes = 1600 tokens.
    let w = wan(8.0, 20.0);
    assert_eq!(kv_arrival_ms(&p, &w, 1_600 * KVB), 100.0);
    assert_eq!(choose_pipeline(&p, &w, &req(1_600, 0, None)), Pipeline::PMd);
    assert_eq!(
        choose_pipeline(&p, &w, &req(1_601, 0, None)),
        Pipeline::PRldMd
    );
}

#[test]
fn a_budget_below_the_handshake_always_uses_rld() {
    let p = PipelinePolicy {
        ttft_budget_ms: 10.0,
        ..PipelinePolicy::default()
    };
    assert_eq!(
        choose_pipeline(&p, &wan(100.0, 30.0), &req(1000, 1000, None)),
        Pipeline::PRldMd
    );
}

#[test]
fn choose_pipeline_never_returns_p_rld() {
    let p = PipelinePolicy::default();
    for (prompt, cached) in [(0, 0), (100_000, 0), (100_000, 100_000), (10, 5)] {
        let got = choose_pipeline(&p, &wan(1.0, 100.0), &req(prompt, cached, Some(1)));
        assert_ne!(got, Pipeline::PRld);
    }
}

#[test]
fn pipeline_names_and_properties() {
    assert_eq!(Pipeline::PMd.name(), "p_md");
    assert_eq!(Pipeline::PRldMd.name(), "p_rld_md");
    assert_eq!(Pipeline::PRld.name(), "p_rld");
    assert!(Pipeline::PMd.sends_kv_over_wan() && !Pipeline::PMd.uses_rld());
    assert!(Pipeline::PRldMd.sends_kv_over_wan() && Pipeline::PRldMd.uses_rld());
    assert!(!Pipeline::PRld.sends_kv_over_wan() && Pipeline::PRld.uses_rld());
}

#[test]
fn huge_requests_saturate_instead_of_overflowing() {
    let r = RequestShape {
        prompt_tokens: u64::MAX,
        md_cached_tokens: 0,
        kv_bytes_per_token: u64::MAX,
        expected_output_tokens: None,
    };
    let d = route(&RoutingPolicy::default(), &wan(100.0, 1.0), &r).unwrap();
    assert_eq!(d.pipeline, Pipeline::PRldMd);
    assert!(d.kv_arrival_ms.is_finite());
}

// ---- anomaly filter ----

#[test]
fn anomaly_needs_all_three_conditions() {
    let a = AnomalyPolicy::default();
    // 100K input, 5% hit, 20 output tokens: the textbook anomaly.
    assert!(is_anomaly(&a, &req(100_000, 5_000, Some(20))));
    // Any one condition missing and it is not.
    assert!(!is_anomaly(&a, &req(20_000, 1_000, Some(20)))); // short input
    assert!(!is_anomaly(&a, &req(100_000, 50_000, Some(20)))); // hit 50%
    assert!(!is_anomaly(&a, &req(100_000, 5_000, Some(500)))); // long output
    assert!(!is_anomaly(&a, &req(100_000, 5_000, None))); // unknown output
}

#[test]
fn anomaly_thresholds_are_strict() {
    let a = AnomalyPolicy {
        long_input_tokens: 1000,
        low_hit_rate: 0.5,
        short_output_tokens: 10,
    };
    assert!(is_anomaly(&a, &req(1001, 0, Some(9))));
    assert!(!is_anomaly(&a, &req(1000, 0, Some(9)))); // not above the input threshold
    assert!(!is_anomaly(&a, &req(1001, 0, Some(10)))); // not below the output threshold
    assert!(!is_anomaly(&a, &req(2000, 1000, Some(9)))); // hit exactly 0.5: not below
    assert!(is_anomaly(&a, &req(2000, 999, Some(9))));
}

#[test]
fn disabled_filter_flags_nothing() {
    let a = AnomalyPolicy::disabled();
    a.validate().unwrap();
    assert!(!is_anomaly(&a, &req(u64::MAX, 0, Some(0))));
}

#[test]
fn route_applies_the_filter_first() {
    let p = RoutingPolicy::default();
    let w = wan(10.0, 30.0);
    let d = route(&p, &w, &req(100_000, 5_000, Some(20))).unwrap();
    assert_eq!(d.pipeline, Pipeline::PRld);
    assert!(d.anomaly);
    assert_eq!(d.missing_tokens, 95_000);
    assert!(d.kv_arrival_ms > p.pipeline.ttft_budget_ms);
    // The same request with a long output goes P-RLD-MD.
    let d = route(&p, &w, &req(100_000, 5_000, Some(2000))).unwrap();
    assert_eq!((d.pipeline, d.anomaly), (Pipeline::PRldMd, false));
    let d = route(&p, &w, &req(100_000, 99_000, Some(20))).unwrap();
    assert_eq!((d.pipeline, d.anomaly), (Pipeline::PMd, false));
}

// ---- validation ----

#[test]
fn invalid_tunables_and_inputs_are_refused() {
    assert!(is_invalid(WanEstimate::new(0.0, 10.0)));
    assert!(is_invalid(WanEstimate::new(-1.0, 10.0)));
    assert!(is_invalid(WanEstimate::new(f64::NAN, 10.0)));
    assert!(is_invalid(WanEstimate::new(f64::INFINITY, 10.0)));
    assert!(is_invalid(WanEstimate::new(10.0, -1.0)));
    assert!(is_invalid(WanEstimate::new(10.0, f64::NAN)));
    WanEstimate::new(10.0, 0.0).unwrap();

    let ok = PipelinePolicy::default();
    ok.validate().unwrap();
    for bad in [
        PipelinePolicy {
            ttft_budget_ms: -1.0,
            ..ok
        },
        PipelinePolicy {
            ttft_budget_ms: f64::NAN,
            ..ok
        },
        PipelinePolicy {
            ttft_budget_ms: f64::INFINITY,
            ..ok
        },
        PipelinePolicy {
            setup_rtts: -0.5,
            ..ok
        },
        PipelinePolicy {
            goodput_share: 0.0,
            ..ok
        },
        PipelinePolicy {
            goodput_share: 1.01,
            ..ok
        },
        PipelinePolicy {
            goodput_share: f64::NAN,
            ..ok
        },
    ] {
        assert!(is_invalid(bad.validate()), "{bad:?}");
    }

    let a = AnomalyPolicy::default();
    a.validate().unwrap();
    for rate in [-0.1, 1.1, f64::NAN] {
        let bad = AnomalyPolicy {
            low_hit_rate: rate,
            ..a
        };
        assert!(is_invalid(bad.validate()));
        assert!(is_invalid(
            RoutingPolicy {
                anomaly: bad,
                ..RoutingPolicy::default()
            }
            .validate()
        ));
    }

    assert!(is_invalid(req(10, 11, None).validate()));
    assert!(is_invalid(route(
        &RoutingPolicy::default(),
        &wan(1.0, 1.0),
        &req(10, 11, None)
    )));
}

#[test]
fn defaults_are_valid_and_documented_values() {
    let p = RoutingPolicy::default();
    p.validate().unwrap();
    assert_eq!(p.pipeline.ttft_budget_ms, 500.0);
    assert_eq!(p.pipeline.setup_rtts, 1.5);
    assert_eq!(p.pipeline.goodput_share, 0.8);
    assert_eq!(p.anomaly.long_input_tokens, 32_768);
    assert_eq!(p.anomaly.low_hit_rate, 0.2);
    assert_eq!(p.anomaly.short_output_tokens, 64);
}

// ---- properties ----

fn pipeline_policy() -> impl Strategy<Value = PipelinePolicy> {
    (0.0f64..5_000.0, 0.0f64..4.0, 0.01f64..=1.0).prop_map(|(b, r, s)| PipelinePolicy {
        ttft_budget_ms: b,
        setup_rtts: r,
        goodput_share: s,
    })
}

fn anomaly_policy() -> impl Strategy<Value = AnomalyPolicy> {
    (0u64..200_000, 0.0f64..=1.0, 0u64..2_000).prop_map(|(l, h, s)| AnomalyPolicy {
        long_input_tokens: l,
        low_hit_rate: h,
        short_output_tokens: s,
    })
}

fn wan_estimate() -> impl Strategy<Value = WanEstimate> {
    (0.01f64..400.0, 0.0f64..300.0).prop_map(|(g, r)| wan(g, r))
}

fn request() -> impl Strategy<Value = RequestShape> {
    (
        0u64..300_000,
        0.0f64..=1.0,
        1u64..200_000,
        prop::option::of(0u64..5_000),
    )
        .prop_map(|(prompt, hit, kvb, out)| RequestShape {
            prompt_tokens: prompt,
            md_cached_tokens: ((prompt as f64) * hit) as u64,
            kv_bytes_per_token: kvb,
            expected_output_tokens: out,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// More missing tokens never flip P-RLD-MD back to P-MD.
    #[test]
    fn more_missing_tokens_never_choose_p_md(
        p in pipeline_policy(), w in wan_estimate(), r in request(), extra in 0u64..100_000,
    ) {
        // Fewer cached tokens, same prompt.
        let fewer_cached = RequestShape { md_cached_tokens: r.md_cached_tokens.saturating_sub(extra), ..r };
        // A longer prompt, same cache.
        let longer = RequestShape { prompt_tokens: r.prompt_tokens + extra, ..r };
        if choose_pipeline(&p, &w, &r) == Pipeline::PRldMd {
            prop_assert_eq!(choose_pipeline(&p, &w, &fewer_cached), Pipeline::PRldMd);
            prop_assert_eq!(choose_pipeline(&p, &w, &longer), Pipeline::PRldMd);
        }
    }

    /// A worse WAN (lower goodput, longer RTT) or a smaller budget never choose P-MD
    /// where the better one chose P-RLD-MD.
    #[test]
    fn a_worse_wan_or_tighter_budget_never_choose_p_md(
        p in pipeline_policy(), w in wan_estimate(), r in request(),
        g in 0.01f64..=1.0, rtt_add in 0.0f64..100.0, b in 0.0f64..=1.0,
    ) {
        if choose_pipeline(&p, &w, &r) == Pipeline::PRldMd {
            let worse = wan(w.goodput_gbit() * g, w.rtt_ms() + rtt_add);
            prop_assert_eq!(choose_pipeline(&p, &worse, &r), Pipeline::PRldMd);
            let tighter = PipelinePolicy { ttft_budget_ms: p.ttft_budget_ms * b, ..p };
            prop_assert_eq!(choose_pipeline(&tighter, &w, &r), Pipeline::PRldMd);
        }
    }

    /// A higher hit rate never makes a request an anomaly; neither does a longer
    /// expected output.
    #[test]
    fn more_hit_or_longer_output_never_make_an_anomaly(
        a in anomaly_policy(), r in request(), more in 0u64..300_000, out_add in 0u64..5_000,
    ) {
        if !is_anomaly(&a, &r) {
            let hotter = RequestShape {
                md_cached_tokens: (r.md_cached_tokens + more).min(r.prompt_tokens),
                ..r
            };
            prop_assert!(!is_anomaly(&a, &hotter));
            let longer_out = RequestShape {
                expected_output_tokens: r.expected_output_tokens.map(|o| o + out_add),
                ..r
            };
            prop_assert!(!is_anomaly(&a, &longer_out));
        }
    }

    /// route() picks P-RLD exactly for anomalies, and otherwise agrees with
    /// choose_pipeline; its arrival estimate is what kv_arrival_ms says.
    #[test]
    fn route_is_filter_then_choice(
        p in pipeline_policy(), a in anomaly_policy(), w in wan_estimate(), r in request(),
    ) {
        let policy = RoutingPolicy { pipeline: p, anomaly: a };
        policy.validate().unwrap();
        let d = route(&policy, &w, &r).unwrap();
        prop_assert_eq!(d.anomaly, is_anomaly(&a, &r));
        prop_assert_eq!(d.pipeline == Pipeline::PRld, d.anomaly);
        if !d.anomaly {
            prop_assert_eq!(d.pipeline, choose_pipeline(&p, &w, &r));
        }
        prop_assert_eq!(d.missing_tokens, r.missing_tokens());
        prop_assert_eq!(
            d.kv_arrival_ms.to_bits(),
            kv_arrival_ms(&p, &w, r.missing_tokens().saturating_mul(r.kv_bytes_per_token)).to_bits()
        );
    }

    /// The hit rate is a fraction, and the arrival estimate never beats the handshake.
    #[test]
    fn hit_rate_and_arrival_bounds(p in pipeline_policy(), w in wan_estimate(), r in request()) {
        let h = r.md_hit_rate();
        prop_assert!((0.0..=1.0).contains(&h));
        let t = kv_arrival_ms(&p, &w, r.missing_tokens() * r.kv_bytes_per_token);
        prop_assert!(t >= p.setup_rtts * w.rtt_ms());
    }
}
