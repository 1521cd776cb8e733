//! PyO3 binding of the `prio` crate's Prio3SumVec for shuffledp (issue 45, phase 1).
//!
//! Everything cryptographic (field arithmetic, the FLP, the XOF, sharding, verification) is the crate's:
//! this file only converts between Python values and the crate's types, and every message crosses the boundary
//! as the crate's own `Encode` output, so it can travel over gRPC as it is. `prio = "=0.18.1"` implements
//! draft-irtf-cfrg-vdaf-18 (crate README, "Draft versions and release branches"); section numbers below are
//! that draft's.

use prio::codec::{CodecError, Encode, ParameterizedDecode};
use prio::field::{Field128, Field64, FieldElementWithInteger, NttFriendlyFieldElement};
use prio::flp::gadgets::{Mul, ParallelSum};
use prio::flp::types::SumVec;
use prio::flp::{Flp, FlpError, Gadget, Type};
use prio::vdaf::prio3::{
    optimal_chunk_length, Prio3, Prio3InputShare, Prio3PublicShare, Prio3VerifierMessage,
    Prio3VerifierShare, Prio3VerifyState,
};
use prio::vdaf::test_utils::TestVectorClient;
use prio::vdaf::xof::XofTurboShake128;
use prio::vdaf::{
    Aggregatable, AggregateShare, Aggregator, Client, Collector, OutputShare, Vdaf,
    VdafError as CrateVdafError, VerifyTransition,
};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

create_exception!(
    shuffledp_prio,
    VdafError,
    PyValueError,
    "A Prio3 operation failed: a bad parameter or measurement, or a message that did not decode or verify."
);
create_exception!(
    shuffledp_prio,
    DecodeError,
    VdafError,
    "A message (public share, input share, verifier share or message, state, output or aggregate share) \
     did not decode as the crate's encoding for this instance: wrong length or malformed."
);
create_exception!(
    shuffledp_prio,
    VerificationError,
    VdafError,
    "The joint verification rejected the report (draft-18 section 7.2.2): the FLP's decision failed \
     (invalid measurement, forged proof or mismatched share) or the joint randomness did not match."
);

/// SEED_SIZE of XofTurboShake128 (draft-18 section 6.2.1): the verification key's and every seed's size.
const VERIFY_KEY_SIZE: usize = 32;
/// NONCE_SIZE of Prio3 (draft-18 section 7.2).
const NONCE_SIZE: usize = 16;
/// Prio3SumVec's registered code point (draft-18 section 10, table "codepoints").
const ALG_ID_SUMVEC: u32 = 0x0000_0003;
/// Prio3SumVecWithMultiproof's code point in the draft-18 reference implementation (poc/vdaf_poc/vdaf_prio3.py)
/// and in its test vectors: a "Reserved for Private Use" value (section 10), as the variant is not registered.
const ALG_ID_SUMVEC_MULTIPROOF: u32 = 0xFFFF_FFFF;

fn decode_err(what: &str, e: CodecError) -> PyErr {
    DecodeError::new_err(format!("{what}: {e}"))
}

fn vdaf_err(what: &str, e: CrateVdafError) -> PyErr {
    VdafError::new_err(format!("{what}: {e}"))
}

fn verify_err(what: &str, e: CrateVdafError) -> PyErr {
    VerificationError::new_err(format!("{what}: {e}"))
}

fn fixed<const N: usize>(what: &str, bytes: &[u8]) -> PyResult<[u8; N]> {
    bytes.try_into().map_err(|_| {
        PyValueError::new_err(format!("{what} must be {N} bytes, got {}", bytes.len()))
    })
}

/// The crate's SumVec circuit over field `F` with the ParallelSum(Mul) gadget (draft-18 section 7.4.3).
type SumVecType<F> = SumVec<F, ParallelSum<F, Mul>>;

/// A dishonest Client's circuit, for the rejection tests only: the crate's SumVec in every respect (so the crate's
/// own Prio3 shards and proves with it) except that entry `index` is encoded as the single field element `value`
/// in its lowest bit position, i.e. a claim of `value` for that entry that no bit decomposition of
/// [0, max_measurement] can make. An honest Client cannot produce it (the crate refuses to encode such a
/// measurement); the Aggregators, running the real SumVec, must reject the report.
#[derive(Clone, Debug, PartialEq, Eq)]
struct OutOfRange<F: NttFriendlyFieldElement> {
    inner: SumVecType<F>,
    bits: usize,
    index: usize,
    value: F,
}

impl<F: NttFriendlyFieldElement> Flp for OutOfRange<F>
where
    SumVecType<F>: Flp<Field = F>,
{
    type Field = F;
    fn gadget(&self) -> Vec<Box<dyn Gadget<F>>> {
        self.inner.gadget()
    }
    fn num_gadgets(&self) -> usize {
        self.inner.num_gadgets()
    }
    fn valid(
        &self,
        gadgets: &mut Vec<Box<dyn Gadget<F>>>,
        input: &[F],
        joint_rand: &[F],
        num_shares: usize,
    ) -> Result<Vec<F>, FlpError> {
        self.inner.valid(gadgets, input, joint_rand, num_shares)
    }
    fn input_len(&self) -> usize {
        self.inner.input_len()
    }
    fn proof_len(&self) -> usize {
        self.inner.proof_len()
    }
    fn verifier_len(&self) -> usize {
        self.inner.verifier_len()
    }
    fn joint_rand_len(&self) -> usize {
        self.inner.joint_rand_len()
    }
    fn eval_output_len(&self) -> usize {
        self.inner.eval_output_len()
    }
    fn prove_rand_len(&self) -> usize {
        self.inner.prove_rand_len()
    }
    fn query_rand_len(&self) -> usize {
        self.inner.query_rand_len()
    }
}

impl<F: NttFriendlyFieldElement> Type for OutOfRange<F>
where
    SumVecType<F>: Type<
        Field = F,
        Measurement = Vec<<F as FieldElementWithInteger>::Integer>,
        AggregateResult = Vec<<F as FieldElementWithInteger>::Integer>,
    >,
{
    type Measurement = Vec<<F as FieldElementWithInteger>::Integer>;
    type AggregateResult = Vec<<F as FieldElementWithInteger>::Integer>;
    fn encode_measurement(&self, measurement: &Self::Measurement) -> Result<Vec<F>, FlpError> {
        let mut encoded = self.inner.encode_measurement(measurement)?;
        let start = self.index * self.bits;
        for x in &mut encoded[start..start + self.bits] {
            *x = F::zero();
        }
        encoded[start] = self.value;
        Ok(encoded)
    }
    fn truncate(&self, input: Vec<F>) -> Result<Vec<F>, FlpError> {
        self.inner.truncate(input)
    }
    fn decode_result(
        &self,
        data: &[F],
        num_measurements: usize,
    ) -> Result<Self::AggregateResult, FlpError> {
        self.inner.decode_result(data, num_measurements)
    }
    fn output_len(&self) -> usize {
        self.inner.output_len()
    }
}

/// One pyclass per field choice; the body is the same, over the crate's generic Prio3.
macro_rules! prio3_sum_vec_class {
    ($name:ident, $field:ty, $int:ty, $field_name:expr, $alg_id:expr, $default_proofs:expr, $proofs_ok:expr,
     $proofs_rule:expr, $doc:expr) => {
        #[doc = $doc]
        #[pyclass(module = "shuffledp_prio", frozen)]
        pub struct $name {
            vdaf: Prio3<SumVecType<$field>, XofTurboShake128, VERIFY_KEY_SIZE>,
            ctx: Vec<u8>,
            length: usize,
            max_measurement: $int,
            bits: usize,
            chunk_length: usize,
            num_proofs: u8,
            num_aggregators: u8,
            /// A helper's verify state, decoded once: the crate decodes verifier shares with a state as parameter
            /// (its verifier length and whether joint randomness is used); every state of this instance gives the
            /// same answer, so prep_shares_to_prep needs none from the caller.
            share_decoding_state: Prio3VerifyState<$field, VERIFY_KEY_SIZE>,
        }

        impl $name {
            fn decode_public_share(&self, bytes: &[u8]) -> PyResult<Prio3PublicShare<VERIFY_KEY_SIZE>> {
                Prio3PublicShare::get_decoded_with_param(&self.vdaf, bytes)
                    .map_err(|e| decode_err("public share", e))
            }

            fn decode_input_share(
                &self,
                agg_id: usize,
                bytes: &[u8],
            ) -> PyResult<Prio3InputShare<$field, VERIFY_KEY_SIZE>> {
                Prio3InputShare::get_decoded_with_param(&(&self.vdaf, agg_id), bytes)
                    .map_err(|e| decode_err(&format!("input share of aggregator {agg_id}"), e))
            }

            fn encode<E: Encode>(what: &str, value: &E) -> PyResult<Vec<u8>> {
                value.get_encoded().map_err(|e| VdafError::new_err(format!("encoding {what}: {e}")))
            }

            fn check_agg_id(&self, agg_id: usize) -> PyResult<()> {
                if agg_id >= self.num_aggregators as usize {
                    return Err(PyValueError::new_err(format!(
                        "agg_id must be in [0, {}), got {agg_id}",
                        self.num_aggregators
                    )));
                }
                Ok(())
            }

            fn shares_tuple<'py>(
                &self,
                py: Python<'py>,
                public_share: Prio3PublicShare<VERIFY_KEY_SIZE>,
                input_shares: Vec<Prio3InputShare<$field, VERIFY_KEY_SIZE>>,
            ) -> PyResult<Bound<'py, PyTuple>> {
                let mut out = vec![PyBytes::new(py, &Self::encode("public share", &public_share)?)];
                for share in &input_shares {
                    out.push(PyBytes::new(py, &Self::encode("input share", share)?));
                }
                PyTuple::new(py, out)
            }
        }

        #[pymethods]
        impl $name {
            #[new]
            #[pyo3(signature = (length, max_measurement, chunk_length=None, *, num_proofs=$default_proofs, ctx=b"shuffledp/prio3sumvec".to_vec(), num_aggregators=2))]
            fn new(
                length: usize,
                max_measurement: $int,
                chunk_length: Option<usize>,
                num_proofs: u8,
                ctx: Vec<u8>,
                num_aggregators: u8,
            ) -> PyResult<Self> {
                let proofs_ok: fn(u8) -> bool = $proofs_ok;
                if !proofs_ok(num_proofs) {
                    return Err(PyValueError::new_err(format!("num_proofs: {}, got {num_proofs}", $proofs_rule)));
                }
                if max_measurement == 0 {
                    return Err(VdafError::new_err("max_measurement cannot be zero"));
                }
                // bits = max_measurement.bit_length() (draft-18 section 7.4.3)
                let bits = (<$int>::BITS - max_measurement.leading_zeros()) as usize;
                // The crate's optimal_chunk_length minimises the proof length for length * bits encoded elements
                // (draft-18 section 7.4.3.1: near sqrt(length * bits), found by search).
                let chunk_length = chunk_length.unwrap_or_else(|| optimal_chunk_length(length.saturating_mul(bits)));
                let typ = SumVec::new(max_measurement, length, chunk_length)
                    .map_err(|e| VdafError::new_err(format!("SumVec parameters: {e}")))?;
                let vdaf = Prio3::new(num_aggregators, num_proofs, $alg_id, typ)
                    .map_err(|e| vdaf_err("Prio3 parameters", e))?;
                // A helper state's encoding: its seed, then the joint randomness seed (draft-18 section 7.2.2).
                let share_decoding_state =
                    Prio3VerifyState::get_decoded_with_param(&(&vdaf, 1usize), &[0u8; 2 * VERIFY_KEY_SIZE])
                        .map_err(|e| decode_err("verify state template", e))?;
                Ok(Self {
                    vdaf,
                    ctx,
                    length,
                    max_measurement,
                    bits,
                    chunk_length,
                    num_proofs,
                    num_aggregators,
                    share_decoding_state,
                })
            }

            /// Entries in a measurement.
            #[getter]
            fn length(&self) -> usize {
                self.length
            }
            /// Largest valid entry.
            #[getter]
            fn max_measurement(&self) -> $int {
                self.max_measurement
            }
            /// Bits per entry in the encoding: max_measurement.bit_length().
            #[getter]
            fn bits(&self) -> usize {
                self.bits
            }
            /// The ParallelSum gadget's chunk length.
            #[getter]
            fn chunk_length(&self) -> usize {
                self.chunk_length
            }
            /// Number of independent FLP proofs per report (draft-18 section 7.1.2).
            #[getter]
            fn num_proofs(&self) -> u8 {
                self.num_proofs
            }
            /// Number of Aggregators: 2 here (leader, helper); the test vectors also have 3.
            #[getter]
            fn num_aggregators(&self) -> u8 {
                self.num_aggregators
            }
            /// "Field128" or "Field64" (draft-18 section 6.1.2).
            #[getter]
            fn field(&self) -> &'static str {
                $field_name
            }
            /// The VDAF's algorithm ID, bound into every XOF call (draft-18 section 7.2.6).
            #[getter]
            fn algorithm_id(&self) -> u32 {
                self.vdaf.algorithm_id()
            }
            /// The application context string bound into every XOF call (draft-18 section 5).
            #[getter]
            fn ctx<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
                PyBytes::new(py, &self.ctx)
            }
            /// Size of the Aggregators' shared verification key, in bytes.
            #[classattr]
            fn verify_key_size() -> usize {
                VERIFY_KEY_SIZE
            }
            /// Size of a report's nonce, in bytes.
            #[classattr]
            fn nonce_size() -> usize {
                NONCE_SIZE
            }

            fn __repr__(&self) -> String {
                format!(
                    "{}(length={}, max_measurement={}, chunk_length={}, num_proofs={}, ctx={:?})",
                    stringify!($name),
                    self.length,
                    self.max_measurement,
                    self.chunk_length,
                    self.num_proofs,
                    String::from_utf8_lossy(&self.ctx)
                )
            }

            /// Shard a measurement (draft-18 section 5.1) with the crate's randomness (the OS CSPRNG).
            fn shard<'py>(
                &self,
                py: Python<'py>,
                measurement: Vec<$int>,
                nonce: &[u8],
            ) -> PyResult<Bound<'py, PyTuple>> {
                let nonce: [u8; NONCE_SIZE] = fixed("nonce", nonce)?;
                let (public_share, input_shares) = py
                    .detach(|| self.vdaf.shard(&self.ctx, &measurement, &nonce))
                    .map_err(|e| vdaf_err("shard", e))?;
                self.shares_tuple(py, public_share, input_shares)
            }

            /// Shard with fixed randomness: for the published test vectors only (a report must use fresh
            /// randomness from a CSPRNG, draft-18 section 9.2).
            fn _shard_with_rand<'py>(
                &self,
                py: Python<'py>,
                measurement: Vec<$int>,
                nonce: &[u8],
                rand: &[u8],
            ) -> PyResult<Bound<'py, PyTuple>> {
                let nonce: [u8; NONCE_SIZE] = fixed("nonce", nonce)?;
                let (public_share, input_shares) = py
                    .detach(|| self.vdaf.shard_with_random(&self.ctx, &measurement, &nonce, rand))
                    .map_err(|e| vdaf_err("shard", e))?;
                self.shares_tuple(py, public_share, input_shares)
            }

            /// A dishonest Client's report claiming `value` for entry `index`: for the rejection tests only.
            fn _shard_out_of_range<'py>(
                &self,
                py: Python<'py>,
                measurement: Vec<$int>,
                nonce: &[u8],
                index: usize,
                value: $int,
            ) -> PyResult<Bound<'py, PyTuple>> {
                let nonce: [u8; NONCE_SIZE] = fixed("nonce", nonce)?;
                if index >= self.length {
                    return Err(PyValueError::new_err("index out of the measurement"));
                }
                let typ = OutOfRange::<$field> {
                    inner: SumVec::new(self.max_measurement, self.length, self.chunk_length)
                        .map_err(|e| VdafError::new_err(e.to_string()))?,
                    bits: self.bits,
                    index,
                    value: <$field>::from(value),
                };
                let dishonest = Prio3::<_, XofTurboShake128, VERIFY_KEY_SIZE>::new(self.num_aggregators, self.num_proofs, self.vdaf.algorithm_id(), typ)
                    .map_err(|e| vdaf_err("Prio3 parameters", e))?;
                let (public_share, input_shares) = py
                    .detach(|| dishonest.shard(&self.ctx, &measurement, &nonce))
                    .map_err(|e| vdaf_err("shard", e))?;
                self.shares_tuple(py, public_share, input_shares)
            }

            /// Start verifying one report at Aggregator `agg_id` (draft-18 section 5.2, verify_init).
            fn prepare_init<'py>(
                &self,
                py: Python<'py>,
                verify_key: &[u8],
                agg_id: usize,
                nonce: &[u8],
                public_share: &[u8],
                input_share: &[u8],
            ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
                let verify_key: [u8; VERIFY_KEY_SIZE] = fixed("verify_key", verify_key)?;
                let nonce: [u8; NONCE_SIZE] = fixed("nonce", nonce)?;
                self.check_agg_id(agg_id)?;
                let (state, share) = py.detach(|| -> PyResult<(Vec<u8>, Vec<u8>)> {
                    let public_share = self.decode_public_share(public_share)?;
                    let input_share = self.decode_input_share(agg_id, input_share)?;
                    let (state, share) = self
                        .vdaf
                        .verify_init(&verify_key, &self.ctx, agg_id, &(), &nonce, &public_share, &input_share)
                        .map_err(|e| verify_err("verify_init", e))?;
                    // the state is the Aggregator's own, never sent: its id first, so prepare_next can decode it
                    let mut state_bytes = vec![agg_id as u8];
                    state_bytes.extend(Self::encode("verify state", &state)?);
                    Ok((state_bytes, Self::encode("verifier share", &share)?))
                })?;
                Ok((PyBytes::new(py, &state), PyBytes::new(py, &share)))
            }

            /// Combine every Aggregator's verifier share into the verifier message (draft-18 section 5.2,
            /// verifier_shares_to_message). This is where the FLP's decision runs: an invalid report raises
            /// VerificationError here.
            fn prep_shares_to_prep<'py>(
                &self,
                py: Python<'py>,
                prep_shares: Vec<Vec<u8>>,
            ) -> PyResult<Bound<'py, PyBytes>> {
                let message = py.detach(|| -> PyResult<Vec<u8>> {
                    let shares = prep_shares
                        .iter()
                        .enumerate()
                        .map(|(i, bytes)| {
                            Prio3VerifierShare::get_decoded_with_param(&self.share_decoding_state, bytes)
                                .map_err(|e| decode_err(&format!("verifier share {i}"), e))
                        })
                        .collect::<PyResult<Vec<_>>>()?;
                    let message = self
                        .vdaf
                        .verifier_shares_to_message(&self.ctx, &(), shares)
                        .map_err(|e| verify_err("verifier_shares_to_message", e))?;
                    Self::encode("verifier message", &message)
                })?;
                Ok(PyBytes::new(py, &message))
            }

            /// Finish verifying at one Aggregator (draft-18 section 5.2, verify_next): its output share, or
            /// VerificationError when the joint randomness does not match.
            fn prepare_next<'py>(
                &self,
                py: Python<'py>,
                prep_state: &[u8],
                prep_message: &[u8],
            ) -> PyResult<Bound<'py, PyBytes>> {
                let out = py.detach(|| -> PyResult<Vec<u8>> {
                    let (&agg_id, state_bytes) = prep_state
                        .split_first()
                        .ok_or_else(|| DecodeError::new_err("verify state: empty"))?;
                    self.check_agg_id(agg_id as usize)?;
                    let state = Prio3VerifyState::get_decoded_with_param(&(&self.vdaf, agg_id as usize), state_bytes)
                        .map_err(|e| decode_err("verify state", e))?;
                    let message = Prio3VerifierMessage::get_decoded_with_param(&state, prep_message)
                        .map_err(|e| decode_err("verifier message", e))?;
                    match self
                        .vdaf
                        .verify_next(&self.ctx, state, message)
                        .map_err(|e| verify_err("verify_next", e))?
                    {
                        VerifyTransition::Finish(output_share) => Self::encode("output share", &output_share),
                        VerifyTransition::Continue(..) => {
                            Err(VdafError::new_err("verify_next: Prio3 has one round, it asked for another"))
                        }
                    }
                })?;
                Ok(PyBytes::new(py, &out))
            }

            /// Sum output shares into an aggregate share, starting from `aggregate_share` when given (to
            /// aggregate a batch in parts).
            #[pyo3(signature = (output_shares, aggregate_share=None))]
            fn aggregate<'py>(
                &self,
                py: Python<'py>,
                output_shares: Vec<Vec<u8>>,
                aggregate_share: Option<Vec<u8>>,
            ) -> PyResult<Bound<'py, PyBytes>> {
                let out = py.detach(|| -> PyResult<Vec<u8>> {
                    let mut acc: AggregateShare<$field> = match aggregate_share {
                        Some(bytes) => AggregateShare::get_decoded_with_param(&(&self.vdaf, &()), &bytes)
                            .map_err(|e| decode_err("aggregate share", e))?,
                        None => self.vdaf.aggregate_init(&()),
                    };
                    for (i, bytes) in output_shares.iter().enumerate() {
                        let share = OutputShare::<$field>::get_decoded_with_param(&(&self.vdaf, &()), bytes)
                            .map_err(|e| decode_err(&format!("output share {i}"), e))?;
                        acc.accumulate(&share).map_err(|e| vdaf_err("aggregate", e))?;
                    }
                    Self::encode("aggregate share", &acc)
                })?;
                Ok(PyBytes::new(py, &out))
            }

            /// The aggregate result from every Aggregator's aggregate share (draft-18 section 5.4).
            fn unshard(&self, py: Python<'_>, aggregate_shares: Vec<Vec<u8>>, num_measurements: usize) -> PyResult<Vec<$int>> {
                py.detach(|| -> PyResult<Vec<$int>> {
                    let shares = aggregate_shares
                        .iter()
                        .enumerate()
                        .map(|(i, bytes)| {
                            AggregateShare::<$field>::get_decoded_with_param(&(&self.vdaf, &()), bytes)
                                .map_err(|e| decode_err(&format!("aggregate share {i}"), e))
                        })
                        .collect::<PyResult<Vec<_>>>()?;
                    if shares.len() != self.num_aggregators as usize {
                        return Err(PyValueError::new_err(format!(
                            "unshard needs {} aggregate shares, got {}",
                            self.num_aggregators,
                            shares.len()
                        )));
                    }
                    self.vdaf.unshard(&(), shares, num_measurements).map_err(|e| vdaf_err("unshard", e))
                })
            }
        }
    };
}

prio3_sum_vec_class!(
    Prio3SumVec,
    Field128,
    u128,
    "Field128",
    ALG_ID_SUMVEC,
    1,
    |n| n == 1,
    "Prio3SumVec has one proof (draft-18 section 7.4.3)",
    "Prio3SumVec of draft-18 section 7.4.3: Field128, one proof."
);
prio3_sum_vec_class!(
    Prio3SumVecField64Multiproof,
    Field64,
    u64,
    "Field64",
    ALG_ID_SUMVEC_MULTIPROOF,
    3,
    |n| n >= 3,
    "Field64 with joint randomness needs at least three proofs (draft-18 section 9.7)",
    "Prio3SumVec over Field64 with several proofs (three by default: the least draft-18 section 9.7 allows for a \
     circuit with joint randomness), the draft's Prio3SumVecWithMultiproof (algorithm ID 0xFFFFFFFF)."
);

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("VdafError", py.get_type::<VdafError>())?;
    m.add("DecodeError", py.get_type::<DecodeError>())?;
    m.add("VerificationError", py.get_type::<VerificationError>())?;
    m.add_class::<Prio3SumVec>()?;
    m.add_class::<Prio3SumVecField64Multiproof>()?;
    m.add("PRIO_CRATE_VERSION", "0.18.1")?;
    m.add("VDAF_DRAFT", "draft-irtf-cfrg-vdaf-18")?;
    Ok(())
}
