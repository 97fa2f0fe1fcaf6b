//! Reading structured values out of fuzz input: every read succeeds (zero once the input
//! is used up), so any byte string decodes to some value.

pub(crate) struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Input { bytes }
    }

    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut array = [0u8; N];
        let count = N.min(self.bytes.len());
        array[..count].copy_from_slice(&self.bytes[..count]);
        self.bytes = &self.bytes[count..];
        array
    }

    pub(crate) fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }

    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }

    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }

    pub(crate) fn bool(&mut self) -> bool {
        self.u8() & 1 != 0
    }

    /// A byte count biased towards values that pass range checks: a power of two, a
    /// multiple of 512, the default, or anything.
    pub(crate) fn size(&mut self, default: u64) -> u64 {
        match self.u8() % 4 {
            0 => self.u64(),
            1 => 1u64 << (self.u8() % 64),
            2 => 512 * u64::from(self.u16()),
            _ => default,
        }
    }

    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.bytes)
    }
}
