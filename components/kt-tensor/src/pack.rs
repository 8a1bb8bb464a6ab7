//! Pack plans: which tensors of a set travel together in one buffer.
//!
//! Tensors are grouped by dtype (in the order each dtype first appears, and
//! in set order within a dtype) and laid end to end in buckets of at most
//! `bucket_bytes`. A tensor of a bucket's size or more travels alone, in
//! place (no staging copy). Empty tensors move nothing.

use kt_types::tensor::{DType, TensorDesc};

/// One tensor's place in a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    /// Index of the tensor in the set.
    pub index: usize,
    /// Byte offset inside the bucket.
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bucket {
    /// Tensors copied into a staging buffer, moved as one.
    Packed {
        dtype: DType,
        items: Vec<Item>,
        len: u64,
    },
    /// One large tensor moved in place.
    Direct { index: usize, len: u64 },
}

impl Bucket {
    pub fn len(&self) -> u64 {
        match self {
            Bucket::Packed { len, .. } | Bucket::Direct { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The buckets of `tensors` (whose sizes are valid: see
/// [`kt_types::tensor::TensorMeta::nbytes`]).
pub fn plan(tensors: &[TensorDesc], bucket_bytes: u64) -> Vec<Bucket> {
    let mut dtypes: Vec<DType> = Vec::new();
    for t in tensors {
        if !dtypes.contains(&t.meta.dtype) {
            dtypes.push(t.meta.dtype);
        }
    }
    let mut out = Vec::new();
    for dtype in dtypes {
        let mut items = Vec::new();
        let mut used = 0u64;
        let flush = |items: &mut Vec<Item>, used: &mut u64, out: &mut Vec<Bucket>| {
            if !items.is_empty() {
                out.push(Bucket::Packed {
                    dtype,
                    items: std::mem::take(items),
                    len: *used,
                });
            }
            *used = 0;
        };
        for (index, t) in tensors.iter().enumerate() {
            if t.meta.dtype != dtype {
                continue;
            }
            let len = t.meta.nbytes().unwrap_or(0);
            if len == 0 {
                continue;
            }
            if len >= bucket_bytes {
                out.push(Bucket::Direct { index, len });
                continue;
            }
            if used + len > bucket_bytes {
                flush(&mut items, &mut used, &mut out);
            }
            items.push(Item {
                index,
                offset: used,
                len,
            });
            used += len;
        }
        flush(&mut items, &mut used, &mut out);
    }
    out
}

/// Size of the largest packed bucket (what a staging buffer must hold).
pub fn staging_len(buckets: &[Bucket]) -> u64 {
    buckets
        .iter()
        .filter(|b| matches!(b, Bucket::Packed { .. }))
        .map(Bucket::len)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::tensor::TensorMeta;

    fn t(name: &str, dtype: DType, n: u64) -> TensorDesc {
        TensorDesc {
            name: name.into(),
            meta: TensorMeta::new(dtype, [n]),
        }
    }

    #[test]
    fn groups_by_dtype_in_bounded_buckets() {
        let set = [
            t("a", DType::F32, 100), // 400 B
            t("b", DType::F16, 100), // 200 B
            t("c", DType::F32, 100),
            t("d", DType::F32, 100),
            t("big", DType::F32, 1000), // 4000 B: alone
            t("empty", DType::F16, 0),
        ];
        let b = plan(&set, 1000);
        assert_eq!(
            b,
            vec![
                Bucket::Packed {
                    dtype: DType::F32,
                    items: vec![
                        Item {
                            index: 0,
                            offset: 0,
                            len: 400
                        },
                        Item {
                            index: 2,
                            offset: 400,
                            len: 400
                        }
                    ],
                    len: 800
                },
                // In place as soon as it comes: the open bucket waits.
                Bucket::Direct {
                    index: 4,
                    len: 4000
                },
                Bucket::Packed {
                    dtype: DType::F32,
                    items: vec![Item {
                        index: 3,
                        offset: 0,
                        len: 400
                    }],
                    len: 400
                },
                Bucket::Packed {
                    dtype: DType::F16,
                    items: vec![Item {
                        index: 1,
                        offset: 0,
                        len: 200
                    }],
                    len: 200
                },
            ]
        );
        assert_eq!(staging_len(&b), 800);
        // Every non-empty tensor exactly once.
        let mut seen: Vec<usize> = b
            .iter()
            .flat_map(|b| match b {
                Bucket::Packed { items, .. } => items.iter().map(|i| i.index).collect(),
                Bucket::Direct { index, .. } => vec![*index],
            })
            .collect();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);
    }
}
