use std::time::Duration;

use outrigger_types::GpuState;

use super::*;
use crate::fake::{fake_uuid, healthy_sample};
use crate::sample::{NvLink, Pcie, SignalFailure};

const TICK: Duration = Duration::from_secs(5);

fn device(index: u32) -> DeviceInfo {
    DeviceInfo {
        uuid: fake_uuid(index),
        index,
        name: "test GPU".to_owned(),
        mig_devices: Vec::new(),
    }
}

/// A classifier driven sample by sample, 5 s apart, on an injected clock.
struct Run {
    classifier: Classifier,
    now: Moment,
    device: DeviceInfo,
}

impl Run {
    fn new() -> Self {
        Self::with(&Options::default())
    }

    fn with(options: &Options) -> Self {
        Self {
            classifier: Classifier::new(options),
            now: Moment::now(),
            device: device(0),
        }
    }

    fn sample(&mut self, sample: Sample) -> GpuHealth {
        self.now = self.now.after(TICK);
        self.classifier
            .step(self.now, &self.device, Ok(sample), &[])
    }

    fn fail(&mut self, error: Error) -> GpuHealth {
        self.now = self.now.after(TICK);
        self.classifier
            .step(self.now, &self.device, Err(error), &[])
    }

    fn event(&mut self, event: Event) -> Vec<GpuHealth> {
        self.classifier.observe_events(self.now, &[event])
    }

    fn xid(&mut self, xid: Option<u64>) -> GpuHealth {
        let uuid = self.device.uuid.clone();
        let mut touched = self.event(Event::Xid { uuid, xid });
        assert_eq!(touched.len(), 1);
        touched.remove(0)
    }

    /// Good samples every 5 s for `span`; returns the last verdict.
    fn healthy_for(&mut self, span: Duration) -> GpuHealth {
        let mut last = self.sample(healthy_sample());
        let mut elapsed = TICK;
        while elapsed < span {
            last = self.sample(healthy_sample());
            elapsed += TICK;
        }
        last
    }
}

fn hot(temperature: u32) -> Sample {
    Sample {
        temperature_c: Some(temperature),
        ..healthy_sample()
    }
}

/// One sample, judged by a one-shot classifier: (case, sample, state, first reason).
#[test]
fn single_sample_rules() {
    type Case = (&'static str, fn(&mut Sample), GpuState, Option<ReasonCode>);
    let cases: Vec<Case> = vec![
        ("baseline", |_| {}, GpuState::Healthy, None),
        (
            "consumer GPU without ECC, NVLink or remapping",
            |s| *s = Sample::default(),
            GpuState::Healthy,
            None,
        ),
        (
            "recovery action asks for a reset",
            |s| s.recovery_action = Some(1),
            GpuState::Unhealthy,
            Some(ReasonCode::RecoveryAction),
        ),
        (
            "volatile uncorrectable ECC",
            |s| s.ecc.uncorrected_volatile = Some(2),
            GpuState::Unhealthy,
            Some(ReasonCode::EccUncorrected),
        ),
        (
            "aggregate uncorrectable ECC alone is history, not a fault",
            |s| s.ecc.uncorrected_aggregate = Some(7),
            GpuState::Healthy,
            None,
        ),
        (
            "ECC switched off",
            |s| s.ecc_enabled = Some(false),
            GpuState::Degraded,
            Some(ReasonCode::EccDisabled),
        ),
        (
            "row remap failure",
            |s| s.remapped_rows.failure = Some(true),
            GpuState::Unhealthy,
            Some(ReasonCode::RowRemapFailure),
        ),
        (
            "row remap pending",
            |s| s.remapped_rows.pending = Some(true),
            GpuState::Degraded,
            Some(ReasonCode::RowRemapPending),
        ),
        (
            "512 uncorrectable remapped rows",
            |s| s.remapped_rows.uncorrectable = Some(512),
            GpuState::Degraded,
            Some(ReasonCode::RemappedRowsHigh),
        ),
        (
            "511 uncorrectable remapped rows",
            |s| s.remapped_rows.uncorrectable = Some(511),
            GpuState::Healthy,
            None,
        ),
        (
            "63 retired pages",
            |s| {
                s.retired_pages.single_bit = Some(40);
                s.retired_pages.double_bit = Some(23);
            },
            GpuState::Unhealthy,
            Some(ReasonCode::RetiredPagesHigh),
        ),
        (
            "page retirement pending",
            |s| s.retired_pages.pending = Some(true),
            GpuState::Degraded,
            Some(ReasonCode::RetiredPagesPending),
        ),
        (
            "at the slowdown temperature",
            |s| s.temperature_c = Some(87),
            GpuState::Degraded,
            Some(ReasonCode::Thermal),
        ),
        (
            "two degrees below shutdown",
            |s| s.temperature_c = Some(90),
            GpuState::Unhealthy,
            Some(ReasonCode::ThermalCritical),
        ),
        (
            "hardware thermal slowdown",
            |s| s.clock_event_reasons = Some(0x40),
            GpuState::Degraded,
            Some(ReasonCode::ClockSlowdown),
        ),
        (
            "power capping is normal under load",
            |s| s.clock_event_reasons = Some(0x4 | 0x1),
            GpuState::Healthy,
            None,
        ),
        (
            "power unreadable",
            |s| {
                s.power_mw = None;
                s.failed.push(SignalFailure {
                    signal: "power".to_owned(),
                    error: "an internal driver error occurred".to_owned(),
                });
            },
            GpuState::Degraded,
            Some(ReasonCode::PowerUnreadable),
        ),
        (
            "power not supported is not a fault",
            |s| {
                s.power_mw = None;
                s.absent.push("power".to_owned());
            },
            GpuState::Healthy,
            None,
        ),
        (
            "PCIe link trained down to x8",
            |s| s.pcie.width = Some(8),
            GpuState::Degraded,
            Some(ReasonCode::PcieLinkWidth),
        ),
        (
            "PCIe generation below max is idle power saving",
            |s| s.pcie.generation = Some(1),
            GpuState::Healthy,
            None,
        ),
    ];
    for (case, mutate, state, first_reason) in cases {
        let mut sample = healthy_sample();
        mutate(&mut sample);
        let health = Classifier::one_shot(&Options::default()).step(
            Moment::now(),
            &device(0),
            Ok(sample),
            &[],
        );
        assert_eq!(health.state, state, "{case}: {:?}", health.reasons);
        assert_eq!(
            health.reasons.first().map(|reason| reason.code),
            first_reason,
            "{case}"
        );
    }
}

#[test]
fn xid_classes_follow_the_configured_sets() {
    // (xid, state after it, reason)
    let cases = [
        (Some(79), GpuState::Unhealthy, Some(ReasonCode::XidFatal)),
        (Some(48), GpuState::Unhealthy, Some(ReasonCode::XidFatal)),
        (Some(119), GpuState::Unhealthy, Some(ReasonCode::XidFatal)),
        (Some(94), GpuState::Degraded, Some(ReasonCode::Xid)),
        (Some(63), GpuState::Degraded, Some(ReasonCode::Xid)),
        (Some(13), GpuState::Healthy, None),
        (Some(31), GpuState::Healthy, None),
        (Some(154), GpuState::Healthy, None),
        (None, GpuState::Degraded, Some(ReasonCode::Xid)),
    ];
    for (xid, state, reason) in cases {
        let mut run = Run::new();
        run.sample(healthy_sample());
        let health = run.xid(xid);
        assert_eq!(health.state, state, "XID {xid:?}: {:?}", health.reasons);
        assert_eq!(
            health.reasons.first().map(|r| r.code),
            reason,
            "XID {xid:?}"
        );
        let key = xid.map_or_else(|| "unknown".to_owned(), |xid| xid.to_string());
        assert_eq!(
            health.xid_counts.get(&key),
            Some(&1),
            "every XID is counted"
        );
    }

    let custom = Options {
        fatal_xids: [94].into_iter().collect(),
        ignored_xids: [79].into_iter().collect(),
        ..Options::default()
    };
    let mut run = Run::with(&custom);
    run.sample(healthy_sample());
    assert_eq!(run.xid(Some(79)).state, GpuState::Healthy);
    assert_eq!(run.xid(Some(48)).state, GpuState::Degraded);
    assert_eq!(run.xid(Some(94)).state, GpuState::Unhealthy);

    // A configured fatal XID wins over the built-in ignore list.
    let strict = Options {
        fatal_xids: [13].into_iter().collect(),
        ..Options::default()
    };
    assert!(strict.ignored_xids.contains(&13));
    let mut run = Run::with(&strict);
    run.sample(healthy_sample());
    assert_eq!(run.xid(Some(31)).state, GpuState::Healthy, "still ignored");
    let health = run.xid(Some(13));
    assert_eq!(health.state, GpuState::Unhealthy);
    assert_eq!(health.reason_codes(), vec![ReasonCode::XidFatal]);
}

#[test]
fn fatal_xid_is_latched_until_restart() {
    let mut run = Run::new();
    run.sample(healthy_sample());
    let health = run.xid(Some(79));
    assert_eq!(health.state, GpuState::Unhealthy);
    assert_eq!(
        health.reasons[0].detail,
        "XID 79 (GPU has fallen off the bus)"
    );
    let since = health.reasons[0].since;
    let later = run.healthy_for(Duration::from_secs(3600));
    assert_eq!(later.state, GpuState::Unhealthy);
    assert_eq!(later.reasons[0].since, since, "the first cause is kept");
}

#[test]
fn non_fatal_xid_clears_after_a_quiet_period() {
    let mut run = Run::new();
    run.sample(healthy_sample());
    assert_eq!(run.xid(Some(94)).state, GpuState::Degraded);
    // Still degraded just short of five quiet minutes...
    let almost = run.healthy_for(Duration::from_secs(295));
    assert_eq!(almost.state, GpuState::Degraded);
    // ...and healthy once they have passed.
    assert_eq!(run.sample(healthy_sample()).state, GpuState::Healthy);
    // A repeat restarts the quiet period.
    run.xid(Some(94));
    run.healthy_for(Duration::from_secs(200));
    assert_eq!(run.xid(Some(94)).state, GpuState::Degraded);
    assert_eq!(
        run.healthy_for(Duration::from_secs(200)).state,
        GpuState::Degraded
    );
}

#[test]
fn double_bit_ecc_event_is_latched() {
    let mut run = Run::new();
    run.sample(healthy_sample());
    let uuid = run.device.uuid.clone();
    let health = run.event(Event::DoubleBitEcc { uuid }).remove(0);
    assert_eq!(health.state, GpuState::Unhealthy);
    assert_eq!(health.reason_codes(), vec![ReasonCode::EccUncorrected]);
    assert_eq!(health.uncorrected_ecc_events, 1);
    assert_eq!(
        run.healthy_for(Duration::from_secs(900)).state,
        GpuState::Unhealthy
    );
}

#[test]
fn thermal_slowdown_needs_three_samples_to_enter_and_a_band_and_quiet_period_to_leave() {
    let mut run = Run::new();
    assert_eq!(run.sample(hot(88)).state, GpuState::Healthy);
    assert_eq!(run.sample(hot(88)).state, GpuState::Healthy);
    let entered = run.sample(hot(88));
    assert_eq!(entered.state, GpuState::Degraded);
    assert_eq!(entered.reason_codes(), vec![ReasonCode::Thermal]);

    // 84 °C is below the 87 °C threshold but inside the 5 °C exit band: still bad, so
    // the quiet period has not even started after five minutes of it.
    for _ in 0..60 {
        assert_eq!(run.sample(hot(84)).state, GpuState::Degraded);
    }
    // Cool: the condition is gone, but it clears only after five quiet minutes.
    let cooled = run.healthy_for(Duration::from_secs(295));
    assert_eq!(cooled.state, GpuState::Degraded);
    assert_eq!(run.sample(healthy_sample()).state, GpuState::Healthy);
}

#[test]
fn an_interrupted_streak_does_not_enter_degraded() {
    let mut run = Run::new();
    for temperature in [88, 88, 40, 88, 88, 40, 88, 88] {
        assert_eq!(run.sample(hot(temperature)).state, GpuState::Healthy);
    }
}

#[test]
fn gpu_lost_and_reset_required_are_latched() {
    for (error, code) in [
        (Error::GpuLost, ReasonCode::GpuLost),
        (Error::ResetRequired, ReasonCode::ResetRequired),
    ] {
        let mut run = Run::new();
        run.sample(healthy_sample());
        let health = run.fail(error.clone());
        assert_eq!(health.state, GpuState::Unhealthy);
        assert_eq!(health.reason_codes(), vec![code]);
        assert_eq!(health.last_error, Some(error));
        let later = run.healthy_for(Duration::from_secs(600));
        assert_eq!(later.state, GpuState::Unhealthy);
        assert_eq!(later.last_error, None);
    }
}

#[test]
fn stale_samples_degrade_then_fail_and_recover_with_data() {
    let mut run = Run::new();
    run.sample(healthy_sample());
    let failing = || Error::Other("an internal driver error occurred".to_owned());
    for _ in 0..3 {
        assert_eq!(run.fail(failing()).state, GpuState::Healthy, "up to 15 s");
    }
    let stale = run.fail(failing());
    assert_eq!(stale.state, GpuState::Degraded, "20 s without data");
    assert_eq!(stale.reason_codes(), vec![ReasonCode::StaleSample]);
    assert!(stale.reasons[0].detail.contains("internal driver error"));
    for _ in 0..8 {
        assert_eq!(run.fail(failing()).state, GpuState::Degraded, "up to 60 s");
    }
    assert_eq!(
        run.fail(failing()).state,
        GpuState::Unhealthy,
        "65 s without data"
    );
    // Staleness is "cannot see", not a fault: data brings the GPU back.
    assert_eq!(run.sample(healthy_sample()).state, GpuState::Healthy);
}

#[test]
fn staleness_grows_without_any_call_while_the_sampler_is_stuck() {
    let mut run = Run::new();
    run.sample(healthy_sample());
    let uuid = run.device.uuid.clone();
    let at = |run: &mut Run, seconds| {
        run.classifier
            .health(run.now.after(Duration::from_secs(seconds)), &uuid)
            .map(|health| health.state)
    };
    assert_eq!(at(&mut run, 10), Some(GpuState::Healthy));
    assert_eq!(at(&mut run, 20), Some(GpuState::Degraded));
    assert_eq!(at(&mut run, 61), Some(GpuState::Unhealthy));
    assert_eq!(run.classifier.health(run.now, "GPU-unknown"), None);
}

#[test]
fn a_fast_interval_does_not_make_one_slow_sample_stale() {
    let fast = Options {
        sample_interval: Duration::from_millis(200),
        ..Options::default()
    };
    let mut run = Run::with(&fast);
    run.sample(healthy_sample());
    let uuid = run.device.uuid.clone();
    let at = |run: &mut Run, millis| {
        run.classifier
            .health(run.now.after(Duration::from_millis(millis)), &uuid)
            .map(|health| health.state)
    };
    // A 3 s NVML call is slow, not hung: the limits are the reference's 15 s and 60 s.
    assert_eq!(at(&mut run, 3_000), Some(GpuState::Healthy));
    assert_eq!(at(&mut run, 14_000), Some(GpuState::Healthy));
    assert_eq!(at(&mut run, 16_000), Some(GpuState::Degraded));
    assert_eq!(at(&mut run, 59_000), Some(GpuState::Degraded));
    assert_eq!(at(&mut run, 61_000), Some(GpuState::Unhealthy));
}

#[test]
fn unknown_until_the_first_good_sample() {
    let mut classifier = Classifier::new(&Options::default());
    let now = Moment::now();
    classifier.track(now, &device(0));
    let health = classifier.health(now, &fake_uuid(0));
    assert_eq!(health.as_ref().map(|h| h.state), Some(GpuState::Unknown));
    assert_eq!(
        health.map(|h| h.reason_codes()),
        Some(vec![ReasonCode::NoSample])
    );

    let failed = classifier.step(
        now,
        &device(0),
        Err(Error::Other("NVML busy".to_owned())),
        &[],
    );
    assert_eq!(failed.state, GpuState::Unknown);
    assert!(failed.reasons[0].detail.contains("NVML busy"));
}

#[test]
fn pcie_replays_are_judged_by_rate_and_survive_counter_resets() {
    let mut run = Run::new();
    let replays = |count| Sample {
        pcie: Pcie {
            replays: Some(count),
            ..healthy_sample().pcie
        },
        ..healthy_sample()
    };
    assert_eq!(run.sample(replays(1000)).state, GpuState::Healthy);
    // Gen 5 x16 allows 31 replays a minute.
    assert_eq!(run.sample(replays(1031)).state, GpuState::Healthy);
    let burst = run.sample(replays(1032));
    assert_eq!(burst.state, GpuState::Degraded);
    assert_eq!(burst.reason_codes(), vec![ReasonCode::PcieReplayRate]);

    // A driver reload zeroes the counter: re-baseline, no negative delta.
    let mut run = Run::new();
    run.sample(replays(5000));
    assert_eq!(run.sample(replays(3)).state, GpuState::Healthy);
    assert_eq!(run.sample(replays(10)).state, GpuState::Healthy);
    // Slow growth never fills a minute's budget.
    for step in 0..40 {
        assert_eq!(run.sample(replays(10 + step)).state, GpuState::Healthy);
    }
}

fn with_links(links: &[(u32, bool, u64, u64, u64)], mig: bool) -> Sample {
    Sample {
        nvlinks: links
            .iter()
            .map(|&(link, active, replay, recovery, crc)| NvLink {
                link,
                active: Some(active),
                replay_errors: Some(replay),
                recovery_errors: Some(recovery),
                crc_flit_errors: Some(crc),
                crc_data_errors: Some(0),
            })
            .collect(),
        mig_enabled: Some(mig),
        ..healthy_sample()
    }
}

#[test]
fn nvlink_rules() {
    // A link that was up at baseline going down is fatal...
    let mut run = Run::new();
    run.sample(with_links(&[(0, true, 0, 0, 0), (1, true, 0, 0, 0)], false));
    let down = run.sample(with_links(
        &[(0, true, 0, 0, 0), (1, false, 0, 0, 0)],
        false,
    ));
    assert_eq!(down.state, GpuState::Unhealthy);
    assert_eq!(down.reason_codes(), vec![ReasonCode::NvlinkDown]);
    // ...but not in MIG mode, where NVML reports links as down, nor for a link that
    // was never up.
    let mut run = Run::new();
    run.sample(with_links(
        &[(0, true, 0, 0, 0), (1, false, 0, 0, 0)],
        false,
    ));
    let mig = run.sample(with_links(
        &[(0, false, 0, 0, 0), (1, false, 0, 0, 0)],
        true,
    ));
    assert_eq!(mig.state, GpuState::Healthy);

    let cases = [
        (
            "recovery error",
            (0, true, 0, 1, 0),
            GpuState::Unhealthy,
            ReasonCode::NvlinkRecoveryErrors,
        ),
        (
            "replay error",
            (0, true, 2, 0, 0),
            GpuState::Degraded,
            ReasonCode::NvlinkReplayErrors,
        ),
        (
            "a few CRC errors",
            (0, true, 0, 0, 3),
            GpuState::Degraded,
            ReasonCode::NvlinkCrcErrors,
        ),
        (
            "CRC burst of 200/s",
            (0, true, 0, 0, 1000),
            GpuState::Unhealthy,
            ReasonCode::NvlinkCrcBurst,
        ),
    ];
    for (case, link, state, code) in cases {
        let mut run = Run::new();
        run.sample(with_links(&[(0, true, 0, 0, 0)], false));
        let health = run.sample(with_links(&[link], false));
        assert_eq!(health.state, state, "{case}: {:?}", health.reasons);
        assert_eq!(health.reasons.first().map(|r| r.code), Some(code), "{case}");
    }
}

#[test]
fn events_for_an_unknown_gpu_hit_every_gpu() {
    let mut classifier = Classifier::new(&Options::default());
    let now = Moment::now();
    for index in 0..2 {
        classifier.step(now, &device(index), Ok(healthy_sample()), &[]);
    }
    let touched = classifier.observe_events(
        now,
        &[Event::Xid {
            uuid: "unknown".to_owned(),
            xid: Some(79),
        }],
    );
    assert_eq!(touched.len(), 2);
    assert!(touched.iter().all(|gpu| gpu.state == GpuState::Unhealthy));

    // An event for a known GPU touches only that GPU.
    let mut classifier = Classifier::new(&Options::default());
    for index in 0..2 {
        classifier.step(now, &device(index), Ok(healthy_sample()), &[]);
    }
    let touched = classifier.observe_events(
        now,
        &[Event::Xid {
            uuid: fake_uuid(1),
            xid: Some(79),
        }],
    );
    assert_eq!(touched.len(), 1);
    assert_eq!(touched[0].uuid, fake_uuid(1));
    let other = classifier.health(now, &fake_uuid(0)).map(|gpu| gpu.state);
    assert_eq!(other, Some(GpuState::Healthy));
}

#[test]
fn events_passed_to_step_are_applied_before_the_sample() {
    let mut classifier = Classifier::new(&Options::default());
    let health = classifier.step(
        Moment::now(),
        &device(0),
        Ok(healthy_sample()),
        &[Event::Xid {
            uuid: fake_uuid(0),
            xid: Some(95),
        }],
    );
    assert_eq!(health.state, GpuState::Unhealthy);
    assert_eq!(health.xid_history.len(), 1);
    assert_eq!(health.xid_history[0].xid, Some(95));
}

#[test]
fn xid_history_is_bounded() {
    let mut run = Run::new();
    run.sample(healthy_sample());
    for xid in 0..(XID_HISTORY_LEN as u64 + 9) {
        run.xid(Some(1000 + xid));
    }
    let health = run.xid(Some(1041));
    assert_eq!(health.xid_history.len(), XID_HISTORY_LEN);
    assert_eq!(health.xid_history.last().map(|r| r.xid), Some(Some(1041)));
    assert_eq!(health.xid_counts.len(), XID_HISTORY_LEN + 10);
}

#[test]
fn reasons_are_sorted_most_severe_first() {
    let mut sample = healthy_sample();
    sample.remapped_rows.pending = Some(true);
    sample.recovery_action = Some(2);
    let health =
        Classifier::one_shot(&Options::default()).step(Moment::now(), &device(0), Ok(sample), &[]);
    assert_eq!(
        health.reason_codes(),
        vec![ReasonCode::RecoveryAction, ReasonCode::RowRemapPending]
    );
    assert!(health.reasons[0].detail.contains("node reboot"));
}

#[test]
fn helper_tables() {
    assert_eq!(pcie_replay_limit(5, 16), Some(31));
    assert_eq!(pcie_replay_limit(4, 16), Some(16));
    assert_eq!(pcie_replay_limit(3, 8), Some(4));
    assert_eq!(pcie_replay_limit(6, 16), Some(62));
    assert_eq!(pcie_replay_limit(0, 16), None);
    assert_eq!(describe_xid(48), "XID 48 (double-bit ECC error)");
    assert_eq!(describe_xid(4242), "XID 4242");
    assert_eq!(recovery_action_name(0), "none");
    assert_eq!(recovery_action_name(9), "action 9");
    assert_eq!(ReasonCode::ClockSlowdown.as_str(), "hw_slowdown");
}

#[test]
fn one_unreadable_crc_counter_is_not_a_counter_reset() {
    let link = |crc_data_errors| Sample {
        nvlinks: vec![NvLink {
            link: 0,
            active: Some(true),
            replay_errors: Some(0),
            recovery_errors: Some(0),
            crc_flit_errors: Some(5_000),
            crc_data_errors,
        }],
        ..healthy_sample()
    };
    let mut run = Run::new();
    assert_eq!(run.sample(link(Some(3_000))).state, GpuState::Healthy);
    assert_eq!(run.sample(link(Some(3_000))).state, GpuState::Healthy);
    assert_eq!(run.sample(link(None)).state, GpuState::Healthy);
    // The lifetime count read again is no new error.
    let health = run.sample(link(Some(3_000)));
    assert_eq!(health.state, GpuState::Healthy, "{:?}", health.reasons);
}

#[test]
fn an_unreadable_link_state_or_mig_mode_is_not_a_link_down() {
    let up = || with_links(&[(0, true, 0, 0, 0), (1, true, 0, 0, 0)], false);
    let failure = |signal: &str| SignalFailure {
        signal: signal.to_owned(),
        error: "Unknown Error".to_owned(),
    };

    // Link 1's state cannot be read once: unknown, not down.
    let mut run = Run::new();
    run.sample(up());
    let mut unreadable = up();
    unreadable.nvlinks[1] = NvLink {
        link: 1,
        active: None,
        ..NvLink::default()
    };
    unreadable.failed.push(failure("nvlink1_state"));
    let health = run.sample(unreadable);
    assert_eq!(health.state, GpuState::Healthy, "{:?}", health.reasons);
    assert_eq!(run.sample(up()).state, GpuState::Healthy);
    // Read as down, it is down.
    let down = run.sample(with_links(
        &[(0, true, 0, 0, 0), (1, false, 0, 0, 0)],
        false,
    ));
    assert_eq!(down.reason_codes(), vec![ReasonCode::NvlinkDown]);

    // Links read as down while the MIG mode is unreadable: MIG may be why.
    let mut run = Run::new();
    run.sample(up());
    let mut mig_unknown = with_links(&[(0, false, 0, 0, 0), (1, false, 0, 0, 0)], false);
    mig_unknown.mig_enabled = None;
    mig_unknown.failed.push(failure("mig_mode"));
    let health = run.sample(mig_unknown);
    assert_eq!(health.state, GpuState::Healthy, "{:?}", health.reasons);

    // A GPU without MIG at all (the read says "not supported") is still judged.
    let mut run = Run::new();
    run.sample(up());
    let mut no_mig = with_links(&[(0, true, 0, 0, 0), (1, false, 0, 0, 0)], false);
    no_mig.mig_enabled = None;
    no_mig.absent.push("mig_mode".to_owned());
    assert_eq!(run.sample(no_mig).state, GpuState::Unhealthy);
}

/// A wedged GPU: NVML still answers, but every read fails.
fn every_read_failed() -> Sample {
    let failed = [
        "temperature",
        "temperature_slowdown",
        "temperature_shutdown",
        "power",
        "power_limit",
        "energy",
        "utilization",
        "memory",
        "ecc_mode",
        "field_values",
        "clock_event_reasons",
        "pcie_replays",
        "mig_mode",
    ]
    .into_iter()
    .map(|signal| SignalFailure {
        signal: signal.to_owned(),
        error: "Unknown Error".to_owned(),
    })
    .collect();
    Sample {
        failed,
        ..Sample::default()
    }
}

#[test]
fn samples_with_every_core_reading_failed_go_stale() {
    let mut run = Run::new();
    let mut health = run.sample(every_read_failed());
    for _ in 1..24 {
        health = run.sample(every_read_failed());
    }
    assert_eq!(health.state, GpuState::Unhealthy, "{:?}", health.reasons);
    assert_eq!(health.reasons[0].code, ReasonCode::StaleSample);
    assert!(
        health.reasons[0]
            .detail
            .contains("temperature: Unknown Error"),
        "{}",
        health.reasons[0].detail
    );
    assert_eq!(health.last_sampled_at, None);

    // The 15 s / 60 s rule counts from the last sample that read something.
    let mut run = Run::new();
    run.sample(healthy_sample());
    for _ in 0..3 {
        let health = run.sample(every_read_failed());
        assert!(!health.reason_codes().contains(&ReasonCode::StaleSample));
    }
    let stale = run.sample(every_read_failed());
    assert!(
        stale.reason_codes().contains(&ReasonCode::StaleSample),
        "20 s"
    );
    assert_eq!(stale.state, GpuState::Degraded);
    for _ in 0..9 {
        run.sample(every_read_failed());
    }
    assert_eq!(
        run.sample(every_read_failed()).state,
        GpuState::Unhealthy,
        "70 s"
    );
    // A sample that reads again ends the staleness.
    let back = run.sample(healthy_sample());
    assert!(!back.reason_codes().contains(&ReasonCode::StaleSample));
    assert_ne!(back.state, GpuState::Unhealthy);
}

#[test]
fn xid_154_is_judged_by_the_recovery_action_it_announces() {
    // Readable and zero: nothing to do.
    let mut run = Run::new();
    run.sample(healthy_sample());
    assert_eq!(run.xid(Some(154)).state, GpuState::Healthy);
    assert_eq!(run.sample(healthy_sample()).state, GpuState::Healthy);

    // Readable and non-zero: the recovery-action rule decides.
    let mut run = Run::new();
    run.sample(healthy_sample());
    run.xid(Some(154));
    let asks = run.sample(Sample {
        recovery_action: Some(1),
        ..healthy_sample()
    });
    assert_eq!(asks.reason_codes(), vec![ReasonCode::RecoveryAction]);

    // Unreadable: degraded, as any other XID, and cleared the same way.
    let no_field = || Sample {
        recovery_action: None,
        ..healthy_sample()
    };
    let mut run = Run::new();
    run.sample(no_field());
    assert_eq!(
        run.xid(Some(154)).state,
        GpuState::Healthy,
        "judged by the next sample"
    );
    let health = run.sample(no_field());
    assert_eq!(health.state, GpuState::Degraded);
    assert_eq!(health.reason_codes(), vec![ReasonCode::Xid]);
    assert!(
        health.reasons[0].detail.contains("XID 154"),
        "{:?}",
        health.reasons
    );
    assert_eq!(
        run.healthy_for(Duration::from_secs(300)).state,
        GpuState::Healthy
    );
}
