//! Strided views of [`Storage`]: `(storage, element offset, shape, strides)`.
//!
//! Every CPU kernel reads its inputs through a [`View`] and writes its outputs through a
//! [`ViewMut`]. Constructors check that every element of the view lies inside the storage, so
//! the element loops below cannot go out of bounds.

use std::borrow::Cow;

use half::{bf16, f16};
use meshflow_ir::DType;

use super::data::{Storage, TensorData};

/// Why a view could not be built or used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    /// Shape and strides have different ranks.
    #[error("view has shape {shape:?} but strides {strides:?}")]
    RankMismatch {
        /// The shape.
        shape: Vec<u64>,
        /// The strides.
        strides: Vec<u64>,
    },
    /// The view reaches past the end of its storage.
    #[error("view (offset {offset}, shape {shape:?}, strides {strides:?}) reaches element {last} of a buffer of {len}")]
    OutOfBounds {
        /// Offset.
        offset: u64,
        /// Shape.
        shape: Vec<u64>,
        /// Strides.
        strides: Vec<u64>,
        /// The last element reached.
        last: u64,
        /// The storage length.
        len: usize,
    },
    /// Element count mismatch in an assignment.
    #[error("assigning {actual} elements to a view of {expected}")]
    Length {
        /// Elements of the view.
        expected: u64,
        /// Elements supplied.
        actual: u64,
    },
}

/// Row-major (contiguous) strides of `shape`.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1].saturating_mul(shape[k + 1]);
    }
    strides
}

fn check_bounds(len: usize, offset: u64, shape: &[u64], strides: &[u64]) -> Result<(), ViewError> {
    if shape.len() != strides.len() {
        return Err(ViewError::RankMismatch {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        });
    }
    if shape.contains(&0) {
        return Ok(());
    }
    let last = shape.iter().zip(strides).try_fold(offset, |acc, (&e, &s)| {
        (e - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
    });
    match last {
        Some(last) if last < len as u64 => Ok(()),
        _ => Err(ViewError::OutOfBounds {
            offset,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            last: last.unwrap_or(u64::MAX),
            len,
        }),
    }
}

/// Calls `f` with the storage offset of every element of the view, in row-major order.
pub fn for_each_offset(offset: u64, shape: &[u64], strides: &[u64], mut f: impl FnMut(usize)) {
    if shape.contains(&0) {
        return;
    }
    let rank = shape.len();
    if rank == 0 {
        f(offset as usize);
        return;
    }
    let (inner_n, inner_s) = (shape[rank - 1], strides[rank - 1]);
    let mut idx = vec![0u64; rank - 1];
    let mut base = offset;
    loop {
        let mut o = base;
        for _ in 0..inner_n {
            f(o as usize);
            o += inner_s;
        }
        // Odometer over the outer axes.
        let mut k = rank - 1;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            base += strides[k];
            if idx[k] < shape[k] {
                break;
            }
            base -= strides[k] * shape[k];
            idx[k] = 0;
        }
    }
}

/// A read-only strided view.
#[derive(Clone, Debug)]
pub struct View<'a> {
    storage: &'a Storage,
    offset: u64,
    shape: Cow<'a, [u64]>,
    strides: Cow<'a, [u64]>,
}

/// A writable strided view.
#[derive(Debug)]
pub struct ViewMut<'a> {
    storage: &'a mut Storage,
    offset: u64,
    shape: Cow<'a, [u64]>,
    strides: Cow<'a, [u64]>,
}

macro_rules! gather {
    ($view:expr, $conv:expr) => {{
        let v = $view;
        let mut out = Vec::with_capacity(v.numel() as usize);
        match v.storage {
            Storage::F32(s) => for_each_offset(v.offset, &v.shape, &v.strides, |o| {
                out.push($conv(Elem::F(s[o])))
            }),
            Storage::BF16(s) => for_each_offset(v.offset, &v.shape, &v.strides, |o| {
                out.push($conv(Elem::F(s[o].to_f32())))
            }),
            Storage::F16(s) => for_each_offset(v.offset, &v.shape, &v.strides, |o| {
                out.push($conv(Elem::F(s[o].to_f32())))
            }),
            Storage::I32(s) => for_each_offset(v.offset, &v.shape, &v.strides, |o| {
                out.push($conv(Elem::I(i64::from(s[o]))))
            }),
            Storage::I64(s) => for_each_offset(v.offset, &v.shape, &v.strides, |o| {
                out.push($conv(Elem::I(s[o])))
            }),
        }
        out
    }};
}

/// One element read from storage.
#[derive(Copy, Clone)]
enum Elem {
    F(f32),
    I(i64),
}

impl Elem {
    fn f32(self) -> f32 {
        match self {
            Elem::F(v) => v,
            Elem::I(v) => v as f32,
        }
    }

    fn i64(self) -> i64 {
        match self {
            Elem::F(v) => v as i64,
            Elem::I(v) => v,
        }
    }
}

impl<'a> View<'a> {
    /// A view of `storage`; fails when an element lies outside it.
    pub fn new(
        storage: &'a Storage,
        offset: u64,
        shape: Cow<'a, [u64]>,
        strides: Cow<'a, [u64]>,
    ) -> Result<View<'a>, ViewError> {
        check_bounds(storage.len(), offset, &shape, &strides)?;
        Ok(View {
            storage,
            offset,
            shape,
            strides,
        })
    }

    /// The whole tensor, row-major.
    pub fn of(data: &'a TensorData) -> View<'a> {
        View {
            storage: data.storage(),
            offset: 0,
            shape: Cow::Borrowed(data.shape()),
            strides: Cow::Owned(contiguous_strides(data.shape())),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// The storage viewed.
    pub fn storage_ref(&self) -> &'a Storage {
        self.storage
    }

    /// The shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The strides (in elements).
    pub fn strides(&self) -> &[u64] {
        &self.strides
    }

    /// The offset of the first element.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// The elements in row-major order as `f32`.
    pub fn to_f32(&self) -> Vec<f32> {
        gather!(self, Elem::f32)
    }

    /// The elements in row-major order as `i64`.
    pub fn to_i64(&self) -> Vec<i64> {
        gather!(self, Elem::i64)
    }

    /// The elements in row-major order, same element type.
    pub fn to_storage(&self) -> Storage {
        let mut out = Storage::zeros(self.dtype(), 0);
        macro_rules! arm {
            ($s:expr, $o:expr) => {{
                let mut v = Vec::with_capacity(self.numel() as usize);
                for_each_offset(self.offset, &self.shape, &self.strides, |o| v.push($s[o]));
                $o = v;
            }};
        }
        match (self.storage, &mut out) {
            (Storage::F32(s), Storage::F32(o)) => arm!(s, *o),
            (Storage::BF16(s), Storage::BF16(o)) => arm!(s, *o),
            (Storage::F16(s), Storage::F16(o)) => arm!(s, *o),
            (Storage::I32(s), Storage::I32(o)) => arm!(s, *o),
            (Storage::I64(s), Storage::I64(o)) => arm!(s, *o),
            _ => {}
        }
        out
    }

    /// A copy as a row-major tensor.
    pub fn to_tensor(&self) -> TensorData {
        TensorData::new(self.shape.to_vec(), self.to_storage())
            .expect("a gathered view has as many elements as its shape")
    }

    /// The sub-view of index `i` along axis 0 (the axis removed).
    pub fn index0(&self, i: u64) -> Option<View<'a>> {
        let (&n, &s) = (self.shape.first()?, self.strides.first()?);
        (i < n).then(|| View {
            storage: self.storage,
            offset: self.offset + i * s,
            shape: Cow::Owned(self.shape[1..].to_vec()),
            strides: Cow::Owned(self.strides[1..].to_vec()),
        })
    }

    /// Chunk `i` of `parts` equal chunks along axis `axis`.
    pub fn chunk(&self, axis: usize, parts: u64, i: u64) -> Option<View<'a>> {
        let (shape, offset) = chunk_of(&self.shape, &self.strides, self.offset, axis, parts, i)?;
        Some(View {
            storage: self.storage,
            offset,
            shape: Cow::Owned(shape),
            strides: self.strides.clone(),
        })
    }
}

fn chunk_of(
    shape: &[u64],
    strides: &[u64],
    offset: u64,
    axis: usize,
    parts: u64,
    i: u64,
) -> Option<(Vec<u64>, u64)> {
    let (&n, &s) = (shape.get(axis)?, strides.get(axis)?);
    if parts == 0 || n % parts != 0 || i >= parts {
        return None;
    }
    let mut shape = shape.to_vec();
    shape[axis] = n / parts;
    Some((shape, offset + i * (n / parts) * s))
}

macro_rules! scatter {
    ($view:expr, $values:expr, $f:ident, $i:ident) => {{
        let v = $view;
        let values = $values;
        if values.len() as u64 != v.numel() {
            return Err(ViewError::Length {
                expected: v.numel(),
                actual: values.len() as u64,
            });
        }
        let mut it = values.iter();
        let (offset, shape, strides) = (v.offset, &v.shape, &v.strides);
        match &mut *v.storage {
            Storage::F32(s) => for_each_offset(offset, shape, strides, |o| {
                if let Some(&x) = it.next() {
                    s[o] = $f(x);
                }
            }),
            Storage::BF16(s) => for_each_offset(offset, shape, strides, |o| {
                if let Some(&x) = it.next() {
                    s[o] = bf16::from_f32($f(x));
                }
            }),
            Storage::F16(s) => for_each_offset(offset, shape, strides, |o| {
                if let Some(&x) = it.next() {
                    s[o] = f16::from_f32($f(x));
                }
            }),
            Storage::I32(s) => for_each_offset(offset, shape, strides, |o| {
                if let Some(&x) = it.next() {
                    s[o] = $i(x) as i32;
                }
            }),
            Storage::I64(s) => for_each_offset(offset, shape, strides, |o| {
                if let Some(&x) = it.next() {
                    s[o] = $i(x);
                }
            }),
        }
        Ok(())
    }};
}

impl<'a> ViewMut<'a> {
    /// A writable view of `storage`; fails when an element lies outside it.
    pub fn new(
        storage: &'a mut Storage,
        offset: u64,
        shape: Cow<'a, [u64]>,
        strides: Cow<'a, [u64]>,
    ) -> Result<ViewMut<'a>, ViewError> {
        check_bounds(storage.len(), offset, &shape, &strides)?;
        Ok(ViewMut {
            storage,
            offset,
            shape,
            strides,
        })
    }

    /// The whole tensor, row-major.
    pub fn of(data: &'a mut TensorData) -> ViewMut<'a> {
        let shape = data.shape().to_vec();
        let strides = contiguous_strides(&shape);
        ViewMut {
            storage: data.storage_mut(),
            offset: 0,
            shape: Cow::Owned(shape),
            strides: Cow::Owned(strides),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// The shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// A read-only view of the same elements.
    pub fn as_view(&self) -> View<'_> {
        View {
            storage: self.storage,
            offset: self.offset,
            shape: Cow::Borrowed(&self.shape),
            strides: Cow::Borrowed(&self.strides),
        }
    }

    /// Chunk `i` of `parts` equal chunks along `axis`, borrowing this view.
    pub fn chunk_mut(&mut self, axis: usize, parts: u64, i: u64) -> Option<ViewMut<'_>> {
        let (shape, offset) = chunk_of(&self.shape, &self.strides, self.offset, axis, parts, i)?;
        Some(ViewMut {
            storage: self.storage,
            offset,
            shape: Cow::Owned(shape),
            strides: Cow::Borrowed(&self.strides),
        })
    }

    /// Writes `f32` values in row-major order, rounding once to the element type (integers
    /// truncate).
    pub fn assign_f32(&mut self, values: &[f32]) -> Result<(), ViewError> {
        let id = |x: f32| x;
        let to_int = |x: f32| x as i64;
        scatter!(self, values, id, to_int)
    }

    /// Writes `i64` values in row-major order (converted to the element type).
    pub fn assign_i64(&mut self, values: &[i64]) -> Result<(), ViewError> {
        let to_f = |x: i64| x as f32;
        let id = |x: i64| x;
        scatter!(self, values, to_f, id)
    }

    /// Writes elements of the same type in row-major order (bit-exact); other types are
    /// converted.
    pub fn assign_storage(&mut self, values: &Storage) -> Result<(), ViewError> {
        if values.len() as u64 != self.numel() {
            return Err(ViewError::Length {
                expected: self.numel(),
                actual: values.len() as u64,
            });
        }
        let (offset, shape, strides) = (self.offset, &self.shape, &self.strides);
        macro_rules! arm {
            ($d:expr, $s:expr) => {{
                let mut it = $s.iter();
                for_each_offset(offset, shape, strides, |o| {
                    if let Some(&x) = it.next() {
                        $d[o] = x;
                    }
                });
                return Ok(());
            }};
        }
        match (&mut *self.storage, values) {
            (Storage::F32(d), Storage::F32(s)) => arm!(d, s),
            (Storage::BF16(d), Storage::BF16(s)) => arm!(d, s),
            (Storage::F16(d), Storage::F16(s)) => arm!(d, s),
            (Storage::I32(d), Storage::I32(s)) => arm!(d, s),
            (Storage::I64(d), Storage::I64(s)) => arm!(d, s),
            _ => {}
        }
        if values.dtype().is_float() {
            self.assign_f32(&values.to_f32_vec())
        } else {
            self.assign_i64(&values.to_i64_vec())
        }
    }

    /// Copies `src` (same number of elements) in row-major order, converting the element
    /// type if needed.
    pub fn copy_from(&mut self, src: &View<'_>) -> Result<(), ViewError> {
        if src.numel() != self.numel() {
            return Err(ViewError::Length {
                expected: self.numel(),
                actual: src.numel(),
            });
        }
        self.assign_storage(&src.to_storage())
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) {
        let zeros = Storage::zeros(self.dtype(), self.numel() as usize);
        // Same length and type by construction.
        let _ = self.assign_storage(&zeros);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_gather_and_scatter() {
        let t = TensorData::from_f32(DType::F32, &[2, 3], &[0., 1., 2., 3., 4., 5.]).unwrap();
        // Transposed view.
        let v = View::new(
            t.storage(),
            0,
            Cow::Owned(vec![3, 2]),
            Cow::Owned(vec![1, 3]),
        )
        .unwrap();
        assert_eq!(v.to_f32(), vec![0., 3., 1., 4., 2., 5.]);
        let c = View::of(&t).chunk(1, 3, 2).unwrap();
        assert_eq!(c.to_f32(), vec![2., 5.]);
        assert!(View::new(
            t.storage(),
            1,
            Cow::Owned(vec![2, 3]),
            Cow::Owned(vec![3, 1])
        )
        .is_err());
        let mut u = TensorData::zeros(DType::BF16, &[2, 3]).unwrap();
        let mut m = ViewMut::of(&mut u);
        m.chunk_mut(0, 2, 1)
            .unwrap()
            .assign_f32(&[1., 2., 3.])
            .unwrap();
        assert_eq!(u.storage().to_f32_vec(), vec![0., 0., 0., 1., 2., 3.]);
    }
}
