//! The elastic SRQ on a soft device: growth, shrinking, spares, and receive IDs.

use super::*;

/// An SRQ allowed more receives than 65,536 growth steps hold (a device with a deep SRQ,
/// `srq_grow_chunk = 1`) had chunk indexes spill into the generation's bits: a receive
/// of chunk 65,536 + k was read back as chunk k of another generation. The growth step is
/// raised until every chunk's index fits, and the largest one's work request ID reads
/// back as itself.
#[test]
fn every_chunk_index_fits_in_a_receives_work_request_id() {
    for max in [1u32, 8, 65_535, 65_536, 65_537, 1 << 20, (1 << 24) - 1] {
        let chunk = min_chunk(max);
        // The initial chunk (at least one receive) and the growth steps within `max`.
        let chunks = 1 + (max - 1) / chunk;
        assert!(
            chunks <= MAX_CHUNKS,
            "max {max}: {chunks} chunks of {chunk}"
        );
    }
    assert_eq!(min_chunk(64), 1, "a small SRQ keeps the step asked for");
    let generation = 1u64;
    let (idx, slot) = (MAX_CHUNKS as usize - 1, 5u32);
    let wr_id = (generation << GEN_SHIFT) | ((idx as u64) << SLOT_BITS) | u64::from(slot);
    assert!(wr_id < WR_ID_END);
    assert_eq!((wr_id >> GEN_SHIFT) & GEN_MASK, generation);
    assert_eq!(
        ((wr_id & ((1 << GEN_SHIFT) - 1)) >> SLOT_BITS) as usize,
        idx,
        "the chunk index reads back whole"
    );
}

/// An SRQ of 8 receives in chunks of 8, up to 64, watermark 2, on a soft device of
/// `fabric`.
fn small_srq(fabric: &nvmfd_rdma::soft::Fabric, shrink_delay: Duration, t0: Instant) -> ElasticSrq {
    small_srq_up_to(fabric, 64, shrink_delay, t0)
}

/// [`small_srq`], up to `max` receives.
fn small_srq_up_to(
    fabric: &nvmfd_rdma::soft::Fabric,
    max: u32,
    shrink_delay: Duration,
    t0: Instant,
) -> ElasticSrq {
    let dev = fabric.add_device([10, 0, 0, 9].into()).unwrap();
    let pd = Pd::Soft(dev.alloc_pd().unwrap());
    let cfg = SrqConfig {
        initial: 8,
        max,
        low_watermark: 2,
        chunk: 8,
        shrink_delay,
        cover_queues: false,
    };
    let attr = DeviceAttr {
        max_srq_wr: 1024,
        ..dev.attr().unwrap()
    };
    ElasticSrq::new(
        &pd,
        &attr,
        cfg,
        4096,
        Registrar::spawn().unwrap(),
        Arc::default(),
        t0,
    )
    .unwrap()
}

/// Ticks until `done` holds, or fails after a bound: the registrar answers from its thread.
fn tick_until(s: &mut ElasticSrq, now: Instant, what: &str, done: impl Fn(&ElasticSrq) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(s) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        s.tick(now);
        std::thread::yield_now();
    }
}

/// A spare chunk whose registration fails is asked for again after `REGISTER_RETRY`, and
/// meanwhile the SRQ does not wait to grow (the reactor may sleep): a limit event after the
/// retry grows it. Before, the failed spare was never asked for again and a limit event
/// left the SRQ waiting for it for good.
#[test]
fn a_failed_spare_registration_is_asked_for_again_and_the_srq_grows() {
    let fabric = nvmfd_rdma::soft::Fabric::new();
    let t0 = Instant::now();
    let mut s = small_srq(&fabric, Duration::from_secs(60), t0);
    tick_until(&mut s, t0, "the first spare", |s| s.spare.is_some());
    // The next registration fails: the spare asked for after this growth.
    fabric.fail_registrations(1);
    assert!(matches!(s.limit_reached(t0), Change::Grew(16)));
    tick_until(&mut s, t0, "the failed registration's answer", |s| {
        s.counters.srq_errors.load(Ordering::Relaxed) == 1
    });
    // No spare: the SRQ cannot grow now, and does not keep the reactor awake for it.
    assert!(matches!(s.limit_reached(t0), Change::CannotGrow));
    assert!(!s.busy());
    // After the retry delay the spare is asked for again, and the next event grows.
    let later = t0 + REGISTER_RETRY;
    tick_until(&mut s, later, "the spare asked for again", |s| {
        s.spare.is_some()
    });
    assert!(matches!(s.limit_reached(later), Change::Grew(24)));
}

/// An arming of the limit the device refuses (at creation here; after a growth the same)
/// is tried again after `REGISTER_RETRY`: the SRQ then hears of its next low level and
/// grows. Before, it was armed again only by a shrink or a registration retry, so under a
/// steady load it stopped growing.
#[test]
fn a_refused_limit_arming_is_tried_again() {
    let fabric = nvmfd_rdma::soft::Fabric::new();
    fabric.fail_limit_arms(2);
    let t0 = Instant::now();
    let mut s = small_srq(&fabric, Duration::from_secs(60), t0);
    assert_eq!(s.counters.srq_errors.load(Ordering::Relaxed), 1);
    assert_eq!(srq_limit(&s), 0, "armed though the device refused");
    s.tick(t0);
    assert_eq!(srq_limit(&s), 0, "armed again before the retry delay");
    // Refused again: one error for the run of refusals.
    s.tick(t0 + REGISTER_RETRY);
    assert_eq!(srq_limit(&s), 0);
    assert_eq!(s.counters.srq_errors.load(Ordering::Relaxed), 1);
    s.tick(t0 + REGISTER_RETRY * 2);
    assert_eq!(srq_limit(&s), 2, "not armed again after the retry delay");
}

/// The SRQ's armed limit, as the device has it (0: not armed).
fn srq_limit(s: &ElasticSrq) -> u32 {
    s.srq.query().unwrap().srq_limit
}

/// A maximum that is not the initial size plus whole growth steps (the defaults' 256 and
/// 256 with `srq_max = 384`): the last step is smaller, up to the maximum exactly. The
/// SRQ refused to grow past the initial size there ("at srq_max").
#[test]
fn the_last_growth_step_stops_at_the_maximum_exactly() {
    let fabric = nvmfd_rdma::soft::Fabric::new();
    let t0 = Instant::now();
    let mut s = small_srq_up_to(&fabric, 12, Duration::from_secs(60), t0);
    tick_until(&mut s, t0, "the first spare", |s| s.spare.is_some());
    assert!(matches!(s.limit_reached(t0), Change::Grew(12)));
    assert_eq!((s.registered, s.posted), (12, 12));
    assert!(matches!(s.limit_reached(t0), Change::CannotGrow));
}

/// A post of receives the provider refuses part-way (out of memory for the moment): those it
/// did not take are posted at the next flush. They were left out for good, counted as
/// registered and never there for a command.
#[test]
fn receives_a_post_refused_are_posted_at_the_next_flush() {
    let fabric = nvmfd_rdma::soft::Fabric::new();
    let t0 = Instant::now();
    let mut s = small_srq(&fabric, Duration::from_secs(60), t0);
    assert_eq!((s.registered, s.posted), (8, 8));
    // Four receives of chunk 0 completed (commands done) and given back.
    s.consumed(4);
    for slot in 0..4u64 {
        s.completed((s.generation() << GEN_SHIFT) | slot, t0);
    }
    assert_eq!(s.posted, 4);
    fabric.fail_next_srq_posts(1);
    s.flush();
    assert_eq!(s.posted, 5, "one went in, three were refused");
    // The refused ones listed again (as a chunk's undrain lists all its receives): each is
    // posted once.
    let again: Vec<(usize, u32)> = s.pending.clone();
    s.pending.extend(again);
    s.flush();
    assert_eq!(
        (s.registered, s.posted),
        (8, 8),
        "the refused ones are posted, once each"
    );
    assert_eq!(s.chunks[0].as_ref().unwrap().posted, 8);
    assert!(s.pending.is_empty());
}

/// Covering the queues stops at `max`: past it the SRQ holds `max` receives and says it is
/// capped (the reactor warns), and no longer once queues go below it again.
#[test]
fn covering_the_queues_stops_at_the_maximum_and_says_so() {
    let fabric = nvmfd_rdma::soft::Fabric::new();
    let t0 = Instant::now();
    let mut s = small_srq_up_to(&fabric, 24, Duration::from_secs(60), t0);
    s.cfg.cover_queues = true;
    s.reserve(16, t0).unwrap();
    assert!(!s.coverage_capped());
    s.reserve(16, t0).unwrap();
    assert!(s.coverage_capped(), "32 reserved, 24 at most");
    assert_eq!((s.registered, s.reserved()), (24, 32));
    s.unreserve(16);
    assert!(!s.coverage_capped());
}

/// Commands waiting for admission keep their receives off the SRQ, polled but not yet
/// given back: under such a backlog the SRQ runs low though its count of receives posted
/// does not drop, and the shrink decision must see the low, not that count (it drained a
/// chunk as the SRQ neared empty).
#[test]
fn receives_polled_and_not_given_back_count_as_gone_for_the_shrink_decision() {
    let fabric = nvmfd_rdma::soft::Fabric::new();
    let delay = Duration::from_secs(1);
    let t0 = Instant::now();
    let mut s = small_srq(&fabric, delay, t0);
    tick_until(&mut s, t0, "the first spare", |s| s.spare.is_some());
    assert!(matches!(s.limit_reached(t0), Change::Grew(16)));
    assert_eq!(s.posted, 16);
    // Three polls take 4 receives each; the commands wait, their receives not back.
    for _ in 0..3 {
        s.consumed(4);
    }
    s.tick(t0 + delay);
    assert!(
        !s.chunks[1].as_ref().unwrap().draining,
        "a chunk drained with 4 receives left on the SRQ"
    );
}

#[test]
fn a_device_with_too_few_sges_per_receive_for_the_in_capsule_data_is_refused_with_what_fits() {
    let fabric = nvmfd_rdma::soft::Fabric::new();
    let dev = fabric.add_device([10, 0, 0, 9].into()).unwrap();
    let pd = Pd::Soft(dev.alloc_pd().unwrap());
    let attr = DeviceAttr {
        max_srq_sge: 3,
        ..dev.attr().unwrap()
    };
    let cfg = SrqConfig {
        initial: 8,
        max: 64,
        low_watermark: 2,
        chunk: 8,
        shrink_delay: Duration::from_secs(1),
        cover_queues: false,
    };
    let srq = |in_capsule| {
        ElasticSrq::new(
            &pd,
            &attr,
            cfg,
            in_capsule,
            Registrar::spawn().unwrap(),
            Arc::default(),
            Instant::now(),
        )
    };
    let Err(e) = srq(16384) else {
        panic!("16 KiB in the capsule needs 5 SGEs per receive; the device takes 3")
    };
    let e = e.to_string();
    assert!(
        e.contains("takes 3 SGEs") && e.contains("needs 5") && e.contains("at most 8 KiB"),
        "{e}"
    );
    // What fits is taken.
    srq(8192).unwrap();
}
