//! Properties of the handoff-mode policy (`pdd_core::handoff::choose_mode`,
//! `catch_up_step`) that Python callers of `pdd_transport.policy` rely on. The rules
//! themselves are unit-tested in `handoff_unit.rs`.

use pdd_core::handoff::*;
use proptest::prelude::*;

fn handoff_policy() -> impl Strategy<Value = HandoffPolicy> {
    (
        1u32..2_000,
        1u32..2_000,
        0.0f64..=1.0,
        1u32..=MAX_HANDOFF_TOKENS,
    )
        .prop_flat_map(|(threshold, chunk, load, max_eager)| {
            (0..threshold).prop_map(move |level| HandoffPolicy {
                catch_up_threshold_tokens: threshold,
                level_tokens: level,
                chunk_tokens: chunk,
                one_shot_load: load,
                max_eager_tokens: max_eager,
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// A busier RLD never turns One-Shot into Catch-Up; a bigger backlog at the same
    /// load never turns Catch-Up into One-Shot.
    #[test]
    fn mode_is_monotone_in_load_and_backlog(
        p in handoff_policy(), load in 0.0f64..=1.0, more_load in 0.0f64..=1.0,
        backlog in 0u32..5_000, more in 0u32..5_000,
    ) {
        p.validate().unwrap();
        let mode = choose_mode(&p, load, backlog);
        if mode == HandoffMode::OneShot {
            prop_assert_eq!(choose_mode(&p, (load + more_load).min(1.0), backlog), HandoffMode::OneShot);
        } else {
            prop_assert_eq!(choose_mode(&p, load, backlog + more), HandoffMode::CatchUp);
        }
        prop_assert_eq!(choose_mode(&p, f64::NAN, backlog), HandoffMode::OneShot);
    }

    /// A Catch-Up step never hands more than the backlog or a chunk, and hands
    /// everything final once the backlog is level.
    #[test]
    fn catch_up_steps_are_bounded(p in handoff_policy(), backlog in 0u32..10_000) {
        match catch_up_step(&p, backlog) {
            CatchUpStep::Chunk(n) => {
                prop_assert!(backlog > p.level_tokens);
                prop_assert!(n >= 1 && n <= backlog && n <= p.chunk_tokens);
            }
            CatchUpStep::Final => prop_assert!(backlog <= p.level_tokens),
        }
    }
}
