//! Device tensors: a shape, row-major strides and an element type over a
//! `DeviceBuffer`. Tensors are always contiguous; strides are reported in elements.

use crate::error::{cuda, Error, Result};
use crate::runtime::Gpu;
use cust::memory::{CopyDestination, DeviceBuffer, DeviceCopy};
use half::bf16;

/// Element types the kernels read and write.
pub trait DType: Copy + Send + Sync + 'static + std::fmt::Debug {
    /// The bits as stored on the device.
    type Raw: DeviceCopy + cust::memory::bytemuck::Pod;
    const NAME: &'static str;
    const BYTES: usize;
    /// A NaN pattern to poison outputs with before a launch.
    const POISON: Self;
    fn to_raw(self) -> Self::Raw;
    fn from_raw(raw: Self::Raw) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn is_nan(self) -> bool;
}

impl DType for f32 {
    type Raw = f32;
    const NAME: &'static str = "f32";
    const BYTES: usize = 4;
    const POISON: f32 = f32::NAN;
    fn to_raw(self) -> f32 {
        self
    }
    fn from_raw(raw: f32) -> f32 {
        raw
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl DType for bf16 {
    type Raw = u16;
    const NAME: &'static str = "bf16";
    const BYTES: usize = 2;
    const POISON: bf16 = bf16::NAN;
    fn to_raw(self) -> u16 {
        self.to_bits()
    }
    fn from_raw(raw: u16) -> bf16 {
        bf16::from_bits(raw)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> bf16 {
        bf16::from_f64(v)
    }
    fn is_nan(self) -> bool {
        bf16::is_nan(self)
    }
}

/// A contiguous row-major tensor in device memory.
pub struct Tensor<T: DType> {
    buf: DeviceBuffer<T::Raw>,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::TooLarge(format!("shape {shape:?} overflows usize")))
}

/// After a synchronous copy from pageable host memory: the driver may return
/// once the data is staged, before it lands, and the GPU's non-blocking stream
/// does not order itself after that copy; wait, so the next launch reads it.
pub(crate) fn uploaded() -> Result<()> {
    cust::context::CurrentContext::synchronize().map_err(cuda("cuCtxSynchronize"))
}

impl<T: DType> Tensor<T> {
    /// Uploads `data` (row-major) with the given shape, and waits for it.
    pub fn from_host(_gpu: &Gpu, data: &[T], shape: &[usize]) -> Result<Tensor<T>> {
        let n = checked_numel(shape)?;
        if n != data.len() {
            return Err(Error::Shape(format!("shape {shape:?} holds {n} elements, data has {}", data.len())));
        }
        let raw: Vec<T::Raw> = data.iter().map(|v| v.to_raw()).collect();
        let buf = DeviceBuffer::from_slice(&raw).map_err(cuda("cuMemAlloc/cuMemcpyHtoD"))?;
        uploaded()?;
        Ok(Tensor { buf, shape: shape.to_vec(), strides: row_major_strides(shape) })
    }

    /// A tensor filled with `value` (for instance `T::POISON`).
    pub fn filled(_gpu: &Gpu, shape: &[usize], value: T) -> Result<Tensor<T>> {
        let n = checked_numel(shape)?;
        let buf = unsafe { DeviceBuffer::uninitialized(n) }.map_err(cuda("cuMemAlloc"))?;
        let mut t = Tensor { buf, shape: shape.to_vec(), strides: row_major_strides(shape) };
        t.fill(value)?;
        Ok(t)
    }

    /// A tensor of `shape` in an allocation of `capacity` elements (at least
    /// the shape's), every one set to `value`: buffers kept for a range of
    /// token counts, [`Tensor::refit`] to each count's shape.
    pub(crate) fn filled_with_capacity(gpu: &Gpu, shape: &[usize], capacity: usize, value: T) -> Result<Tensor<T>> {
        let n = checked_numel(shape)?;
        if n > capacity {
            return Err(Error::Shape(format!(
                "shape {shape:?} holds {n} elements, more than a capacity of {capacity}"
            )));
        }
        let mut t = Tensor::filled(gpu, &[capacity], value)?;
        t.refit(shape)?;
        Ok(t)
    }

    /// Gives the tensor a shape of at most its allocation's elements: the
    /// first elements of the allocation, row-major. Launches read and write
    /// only the shape's elements, so the rest stay allocated and unread.
    pub(crate) fn refit(&mut self, shape: &[usize]) -> Result<()> {
        // Each step refits every buffer: most often to the shape it has.
        if self.shape == shape {
            return Ok(());
        }
        let n = checked_numel(shape)?;
        if n > self.buf.len() {
            return Err(Error::Shape(format!("shape {shape:?} does not fit {} allocated elements", self.buf.len())));
        }
        self.shape = shape.to_vec();
        self.strides = row_major_strides(shape);
        Ok(())
    }

    /// Bytes of the allocation, which may exceed the shape's ([`Tensor::refit`]).
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.buf.len() * T::BYTES
    }

    /// Sets every element to `value`, and waits for it: the memset runs on the
    /// legacy default stream, which does not order itself with the GPU's
    /// non-blocking stream, so queued work is waited for first (a kernel may
    /// still be writing the tensor), and the memset must be complete before
    /// any kernel reads or writes.
    pub fn fill(&mut self, value: T) -> Result<()> {
        if self.numel() == 0 {
            return Ok(());
        }
        cust::context::CurrentContext::synchronize().map_err(cuda("cuCtxSynchronize"))?;
        let raw = value.to_raw();
        let bits = cust::memory::bytemuck::bytes_of(&raw);
        match T::BYTES {
            4 => self.buf.set_32(u32::from_ne_bytes(bits.try_into().unwrap())),
            2 => self.buf.set_16(u16::from_ne_bytes(bits.try_into().unwrap())),
            _ => unreachable!("DType::BYTES is 2 or 4"),
        }
        .map_err(cuda("cuMemsetD"))?;
        cust::context::CurrentContext::synchronize().map_err(cuda("cuCtxSynchronize"))
    }

    /// Downloads the tensor (synchronously; waits for work on the buffer).
    pub fn to_host(&self, gpu: &Gpu) -> Result<Vec<T>> {
        gpu.synchronize()?;
        let mut raw = vec![T::POISON.to_raw(); self.numel()];
        self.buf.index(..self.numel()).copy_to(&mut raw[..]).map_err(cuda("cuMemcpyDtoH"))?;
        Ok(raw.into_iter().map(T::from_raw).collect())
    }

    /// Replaces the contents with `data` (same number of elements): waits for
    /// queued work first (a kernel may still read or write the tensor), and for
    /// the copy after.
    pub fn copy_from_host(&mut self, gpu: &Gpu, data: &[T]) -> Result<()> {
        if data.len() != self.numel() {
            return Err(Error::Shape(format!("{} elements into a tensor of {}", data.len(), self.numel())));
        }
        gpu.synchronize()?;
        let raw: Vec<T::Raw> = data.iter().map(|v| v.to_raw()).collect();
        self.buf.index(..self.numel()).copy_from(&raw[..]).map_err(cuda("cuMemcpyHtoD"))?;
        uploaded()
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Gives the same elements a new shape (same number of elements).
    pub fn reshape(&mut self, shape: &[usize]) -> Result<()> {
        if checked_numel(shape)? != self.numel() {
            return Err(Error::Shape(format!("cannot view {:?} as {shape:?}", self.shape)));
        }
        self.shape = shape.to_vec();
        self.strides = row_major_strides(shape);
        Ok(())
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn size_bytes(&self) -> usize {
        self.numel() * T::BYTES
    }

    /// Device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.buf.as_device_ptr().as_raw()
    }

    /// Copies `rows` leading-dimension rows of `src` from `src_row` into this
    /// tensor at `dst_row`, on the GPU's stream (queued, not waited for). Both
    /// must have the same row shape.
    pub fn copy_rows_from(
        &mut self,
        gpu: &crate::runtime::Gpu,
        dst_row: usize,
        src: &Tensor<T>,
        src_row: usize,
        rows: usize,
    ) -> Result<()> {
        let row_shape = |t: &Tensor<T>| t.shape.get(1..).map(<[usize]>::to_vec).unwrap_or_default();
        if row_shape(self) != row_shape(src) {
            return Err(Error::Shape(format!("copy rows: {:?} from {:?}", self.shape, src.shape)));
        }
        let lead = |t: &Tensor<T>| t.shape.first().copied().unwrap_or(0);
        if src_row + rows > lead(src) || dst_row + rows > lead(self) {
            return Err(Error::Shape(format!(
                "copy rows: {rows} rows from row {src_row} of {:?} to row {dst_row} of {:?}",
                src.shape, self.shape
            )));
        }
        let row_bytes = row_shape(self).iter().product::<usize>() * T::BYTES;
        if rows == 0 || row_bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie inside their buffers (checked above); the copy is
        // ordered on the stream with the kernels that use them.
        let status = unsafe {
            cust::sys::cuMemcpyDtoDAsync_v2(
                self.device_ptr() + (dst_row * row_bytes) as u64,
                src.device_ptr() + (src_row * row_bytes) as u64,
                rows * row_bytes,
                gpu.stream().as_inner(),
            )
        };
        crate::error::check("cuMemcpyDtoDAsync", status)
    }

    /// (rows, cols) when viewed as a matrix over the last dimension.
    pub fn as_rows(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        let rows = self.numel().checked_div(cols).unwrap_or(0);
        (rows, cols)
    }
}

/// A tensor whose element type is known only at run time; operations on it check
/// dtypes and return [`Error::DType`] on a mismatch.
pub enum DynTensor {
    F32(Tensor<f32>),
    Bf16(Tensor<bf16>),
}

impl DynTensor {
    pub fn dtype_name(&self) -> &'static str {
        match self {
            DynTensor::F32(_) => f32::NAME,
            DynTensor::Bf16(_) => bf16::NAME,
        }
    }
}

impl From<Tensor<f32>> for DynTensor {
    fn from(t: Tensor<f32>) -> Self {
        DynTensor::F32(t)
    }
}

impl From<Tensor<bf16>> for DynTensor {
    fn from(t: Tensor<bf16>) -> Self {
        DynTensor::Bf16(t)
    }
}
