//! Reductions on receive: a quorum getter that asks for the sum or mean of
//! every putter's tensors of a key receives each putter's into scratch
//! memory and adds it here, in the order the flows run (putter rank
//! ascending), so every getter computes the same result.
//!
//! Floats (`f64`, `f32`, `f16`, `bf16`) accumulate in `f64` and are rounded
//! to their dtype once, at the end; integers add in `i64` and wrap around
//! in their own width (as PyTorch's integer sum does); a mean divides the
//! float sum by the number of putters. What [`ReduceOp::check`] refuses
//! (bool, 8-bit floats, an integer mean) is refused here too.

use kt_types::tensor::{DType, ReduceOp, TensorDesc};

use crate::transport::TransportError;

/// The running reduction of one key's tensor set.
#[derive(Debug)]
pub struct Accumulator {
    op: ReduceOp,
    dtypes: Vec<DType>,
    sums: Vec<Sum>,
    /// Sets added so far.
    count: u32,
}

#[derive(Debug)]
enum Sum {
    Float(Vec<f64>),
    Int(Vec<i64>),
}

impl Accumulator {
    /// An empty reduction of sets of this layout, or why `op` is not
    /// defined for one of its dtypes.
    pub fn new(op: ReduceOp, layout: &[TensorDesc]) -> Result<Self, TransportError> {
        let mut sums = Vec::with_capacity(layout.len());
        for d in layout {
            op.check(d.meta.dtype)
                .map_err(|m| TransportError::Invalid(format!("tensor {:?}: {m}", d.name)))?;
            let n = d.meta.nbytes().map_err(TransportError::Invalid)? / d.meta.dtype.size();
            let n = usize::try_from(n).map_err(|_| {
                TransportError::Invalid(format!("tensor {:?} is too large", d.name))
            })?;
            sums.push(if is_float(d.meta.dtype) {
                Sum::Float(vec![0.0; n])
            } else {
                Sum::Int(vec![0; n])
            });
        }
        Ok(Accumulator {
            op,
            dtypes: layout.iter().map(|d| d.meta.dtype).collect(),
            sums,
            count: 0,
        })
    }

    /// Sets added so far.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Adds tensor `index` of the next set, as its bytes (little-endian,
    /// as the tensor holds them). Call it for every tensor of a set, then
    /// [`Accumulator::end_set`].
    pub fn add(&mut self, index: usize, bytes: &[u8]) -> Result<(), TransportError> {
        let (Some(&dtype), Some(sum)) = (self.dtypes.get(index), self.sums.get_mut(index)) else {
            return Err(TransportError::Invalid(format!(
                "tensor {index} of a set of {}",
                self.dtypes.len()
            )));
        };
        let size = dtype.size() as usize;
        let n = match sum {
            Sum::Float(v) => v.len(),
            Sum::Int(v) => v.len(),
        };
        if bytes.len() != n * size {
            return Err(TransportError::Invalid(format!(
                "tensor {index}: {} bytes received, its {n} {dtype} elements take {}",
                bytes.len(),
                n * size
            )));
        }
        let chunks = bytes.chunks_exact(size);
        match sum {
            Sum::Float(v) => {
                for (acc, c) in v.iter_mut().zip(chunks) {
                    *acc += float(dtype, c);
                }
            }
            Sum::Int(v) => {
                for (acc, c) in v.iter_mut().zip(chunks) {
                    *acc = acc.wrapping_add(int(dtype, c));
                }
            }
        }
        Ok(())
    }

    /// One more set was added (every tensor of it).
    pub fn end_set(&mut self) {
        self.count += 1;
    }

    /// The result, tensor by tensor, as bytes of each tensor's dtype.
    pub fn finish(self) -> Vec<Vec<u8>> {
        let divide = match self.op {
            ReduceOp::Sum => 1.0,
            ReduceOp::Mean => f64::from(self.count.max(1)),
        };
        self.sums
            .into_iter()
            .zip(self.dtypes)
            .map(|(sum, dtype)| match sum {
                Sum::Float(v) => v
                    .into_iter()
                    .flat_map(|x| float_bytes(dtype, x / divide))
                    .collect(),
                Sum::Int(v) => v.into_iter().flat_map(|x| int_bytes(dtype, x)).collect(),
            })
            .collect()
    }
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F64 | DType::F32 | DType::F16 | DType::Bf16)
}

fn float(d: DType, c: &[u8]) -> f64 {
    match d {
        DType::F64 => f64::from_le_bytes(c.try_into().unwrap_or_default()),
        DType::F32 => f64::from(f32::from_le_bytes(c.try_into().unwrap_or_default())),
        DType::F16 => half::f16::from_le_bytes(c.try_into().unwrap_or_default()).to_f64(),
        DType::Bf16 => half::bf16::from_le_bytes(c.try_into().unwrap_or_default()).to_f64(),
        _ => 0.0,
    }
}

/// `x` rounded to `d`, as its bytes (elements are at most 8 bytes).
fn float_bytes(d: DType, x: f64) -> Vec<u8> {
    match d {
        DType::F64 => x.to_le_bytes().to_vec(),
        DType::F32 => (x as f32).to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
        _ => half::bf16::from_f64(x).to_le_bytes().to_vec(),
    }
}

fn int(d: DType, c: &[u8]) -> i64 {
    match d {
        DType::I64 => i64::from_le_bytes(c.try_into().unwrap_or_default()),
        DType::I32 => i64::from(i32::from_le_bytes(c.try_into().unwrap_or_default())),
        DType::I16 => i64::from(i16::from_le_bytes(c.try_into().unwrap_or_default())),
        DType::I8 => i64::from(c[0] as i8),
        _ => i64::from(c[0]),
    }
}

/// `x` wrapped to `d`'s width, as its bytes.
fn int_bytes(d: DType, x: i64) -> Vec<u8> {
    match d {
        DType::I64 => x.to_le_bytes().to_vec(),
        DType::I32 => (x as i32).to_le_bytes().to_vec(),
        DType::I16 => (x as i16).to_le_bytes().to_vec(),
        _ => vec![x as u8],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::tensor::TensorMeta;

    fn desc(dtype: DType, n: u64) -> TensorDesc {
        TensorDesc {
            name: format!("{dtype}"),
            meta: TensorMeta::new(dtype, [n]),
        }
    }

    fn reduce(op: ReduceOp, layout: &[TensorDesc], sets: &[Vec<Vec<u8>>]) -> Vec<Vec<u8>> {
        let mut acc = Accumulator::new(op, layout).unwrap();
        for set in sets {
            for (i, t) in set.iter().enumerate() {
                acc.add(i, t).unwrap();
            }
            acc.end_set();
        }
        acc.finish()
    }

    #[test]
    fn sums_and_means_of_floats_round_once() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let bf = |v: &[f32]| {
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let layout = [desc(DType::F32, 2), desc(DType::Bf16, 2)];
        let sets: Vec<Vec<Vec<u8>>> = (1..=8)
            .map(|r| vec![f32s(&[r as f32, -0.5]), bf(&[256.0, 1.0])])
            .collect();
        let sum = reduce(ReduceOp::Sum, &layout, &sets);
        assert_eq!(sum[0], f32s(&[36.0, -4.0]));
        // 256 + 1 is 256 in bf16 (8 bits of mantissa): summed one by one
        // in bf16 the ones would all be lost; accumulated in f64 they are
        // 2048 + 8 = 2056, which bf16 rounds to 2048 or 2064, not 2048 + 0.
        assert_eq!(sum[1], bf(&[2048.0, 8.0]));
        // 256 then seven ones: added one by one in bf16 (8 bits of
        // mantissa, a spacing of 2 at 256) every one is lost; accumulated
        // in f64 the sum is 263, rounded once to 264.
        let one_bf16 = [desc(DType::Bf16, 1)];
        let mut sets_bf: Vec<Vec<Vec<u8>>> = vec![vec![bf(&[256.0])]];
        sets_bf.extend((0..7).map(|_| vec![bf(&[1.0])]));
        assert_eq!(reduce(ReduceOp::Sum, &one_bf16, &sets_bf)[0], bf(&[264.0]));
        let mean = reduce(ReduceOp::Mean, &layout, &sets);
        assert_eq!(mean[0], f32s(&[4.5, -0.5]));
        assert_eq!(mean[1], bf(&[256.0, 1.0]));
        let f16 = [desc(DType::F16, 1)];
        let h = |x: f32| half::f16::from_f32(x).to_le_bytes().to_vec();
        let s = reduce(ReduceOp::Sum, &f16, &[vec![h(0.1)], vec![h(0.2)]]);
        assert_eq!(
            s[0],
            half::f16::from_f64(
                half::f16::from_f32(0.1).to_f64() + half::f16::from_f32(0.2).to_f64()
            )
            .to_le_bytes()
            .to_vec()
        );
    }

    #[test]
    fn integer_sums_wrap_in_their_width() {
        let layout = [desc(DType::U8, 1), desc(DType::I16, 1), desc(DType::I64, 1)];
        let set = |u: u8, i: i16, l: i64| {
            vec![vec![u], i.to_le_bytes().to_vec(), l.to_le_bytes().to_vec()]
        };
        let s = reduce(
            ReduceOp::Sum,
            &layout,
            &[set(200, i16::MAX, -5), set(100, 1, 7)],
        );
        assert_eq!(s[0], vec![44]);
        assert_eq!(s[1], i16::MIN.to_le_bytes().to_vec());
        assert_eq!(s[2], 2i64.to_le_bytes().to_vec());
    }

    #[test]
    fn undefined_reductions_are_refused_saying_why() {
        let e = Accumulator::new(ReduceOp::Sum, &[desc(DType::Bool, 4)]).unwrap_err();
        assert!(e.to_string().contains("bool"), "{e}");
        let e = Accumulator::new(ReduceOp::Mean, &[desc(DType::I32, 4)]).unwrap_err();
        assert!(e.to_string().contains("not an integer"), "{e}");
        let e = Accumulator::new(ReduceOp::Sum, &[desc(DType::F8e4m3, 4)]).unwrap_err();
        assert!(e.to_string().contains("f8e4m3"), "{e}");
        Accumulator::new(ReduceOp::Sum, &[desc(DType::I32, 4)]).unwrap();
        let mut acc = Accumulator::new(ReduceOp::Sum, &[desc(DType::F32, 4)]).unwrap();
        assert!(acc.add(0, &[0; 15]).is_err());
        assert!(acc.add(1, &[0; 16]).is_err());
    }
}
