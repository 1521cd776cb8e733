//! The crate alone, for benchmarks/bench_prio3_native.py: the same Prio3SumVec instances and steps as the binding,
//! in Rust, so the script can state what the binding adds (issue 45: at most 1.5x the crate alone).
//!
//! Run: cargo run --release --example bench_crate -- LENGTH MAX_MEASUREMENT REPEATS
//! Prints one line per field: `field shard_ms init_leader_ms init_helper_ms combine_ms next_leader_ms
//! next_helper_ms aggregate_ms unshard_ms`, each the best of REPEATS (the least disturbed by other processes), like the
//! Python scripts. aggregate_ms: one output share into a fresh aggregate share (an Aggregator's per-report part of
//! aggregation); unshard_ms: the Collector's unshard of both aggregate shares (once per batch). The first seven
//! columns are benchmarks/bench_prio3_native.py's; benchmarks/bench_split_trust.py reads all nine.

use std::time::Instant;

use prio::field::{Field128, Field64};
use prio::flp::gadgets::{Mul, ParallelSum};
use prio::flp::types::SumVec;
use prio::vdaf::prio3::{optimal_chunk_length, Prio3};
use prio::vdaf::xof::XofTurboShake128;
use prio::vdaf::{Aggregatable, Aggregator, Client, Collector, VerifyTransition};
use rand::RngExt;

const CTX: &[u8] = b"shuffledp/prio3sumvec";

fn best<T>(repeats: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..repeats {
        let t0 = Instant::now();
        let r = f();
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
        out = Some(r);
    }
    (best, out.unwrap())
}

macro_rules! bench {
    ($field:ty, $int:ty, $name:expr, $alg:expr, $proofs:expr, $len:expr, $max:expr, $reps:expr) => {{
        let bits = (<$int>::BITS - ($max as $int).leading_zeros()) as usize;
        let typ = SumVec::<$field, ParallelSum<$field, Mul>>::new(
            $max as $int,
            $len,
            optimal_chunk_length($len * bits),
        )
        .unwrap();
        let vdaf: Prio3<_, XofTurboShake128, 32> = Prio3::new(2, $proofs, $alg, typ).unwrap();
        let mut rng = rand::rng();
        let key: [u8; 32] = rng.random();
        let nonce: [u8; 16] = rng.random();
        let measurement: Vec<$int> = (0..$len)
            .map(|_| rng.random_range(0..=($max as $int)))
            .collect();
        let (t_shard, (public, shares)) =
            best($reps, || vdaf.shard(CTX, &measurement, &nonce).unwrap());
        let mut t_init = [0.0; 2];
        let mut states = vec![];
        let mut prep_shares = vec![];
        for (agg_id, share) in shares.iter().enumerate() {
            let (t, (state, prep_share)) = best($reps, || {
                vdaf.verify_init(&key, CTX, agg_id, &(), &nonce, &public, share)
                    .unwrap()
            });
            t_init[agg_id] = t;
            states.push(state);
            prep_shares.push(prep_share);
        }
        let (t_combine, message) = best($reps, || {
            vdaf.verifier_shares_to_message(CTX, &(), prep_shares.clone())
                .unwrap()
        });
        let mut t_next = [0.0; 2];
        let mut out_shares = vec![];
        for (agg_id, state) in states.iter().enumerate() {
            let (t, transition) = best($reps, || {
                vdaf.verify_next(CTX, state.clone(), message.clone())
                    .unwrap()
            });
            let VerifyTransition::Finish(out_share) = transition else {
                panic!("Prio3 has one round")
            };
            t_next[agg_id] = t;
            out_shares.push(out_share);
        }
        let (t_aggregate, agg_leader) = best($reps, || {
            let mut acc = vdaf.aggregate_init(&());
            acc.accumulate(&out_shares[0]).unwrap();
            acc
        });
        let mut agg_helper = vdaf.aggregate_init(&());
        agg_helper.accumulate(&out_shares[1]).unwrap();
        let (t_unshard, result) = best($reps, || {
            vdaf.unshard(&(), vec![agg_leader.clone(), agg_helper.clone()], 1)
                .unwrap()
        });
        assert_eq!(result, measurement, "the round trip lost the measurement");
        println!(
            "{} {:.4} {:.4} {:.4} {:.4} {:.4} {:.4} {:.4} {:.4}",
            $name,
            t_shard,
            t_init[0],
            t_init[1],
            t_combine,
            t_next[0],
            t_next[1],
            t_aggregate,
            t_unshard
        );
    }};
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("integer argument"))
        .collect();
    let [len, max, reps] = args[..] else {
        panic!("usage: bench_crate LENGTH MAX_MEASUREMENT REPEATS")
    };
    bench!(Field128, u128, "Field128", 0x0000_0003, 1, len, max, reps);
    bench!(Field64, u64, "Field64", 0xFFFF_FFFF, 3, len, max, reps);
}
