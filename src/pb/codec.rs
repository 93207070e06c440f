//! The protobuf codec of every `agq.v1` service and client: tonic-prost's
//! encoding with smaller first buffers.
//!
//! tonic gives every call, and every message stream, an encode buffer and
//! a decode buffer of 8 KiB from the start, most of it never filled: AGQ's
//! messages are a few hundred bytes. A worker keeps three streams open
//! (Heartbeat, LeaseJobs, ReportJobs), and with tonic's buffers 10,000
//! idle workers held the server at 435 MB RSS; with these, 273 MB. The
//! buffers start at [`FIRST_BUFFER_BYTES`] here and grow as a message
//! needs (a message of any size up to the size limit still goes
//! through).

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec as TonicCodec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// First capacity of a call's encode and decode buffers, bytes; they grow
/// as a message needs.
pub const FIRST_BUFFER_BYTES: usize = 1024;

/// Encoded bytes a stream gathers before handing them to HTTP/2 (tonic's
/// default).
pub const YIELD_THRESHOLD_BYTES: usize = 32 * 1024;

/// tonic-prost's codec with [`FIRST_BUFFER_BYTES`] buffers; named by
/// `build.rs` as the codec of the generated code.
#[derive(Debug, Clone, Copy)]
pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(FIRST_BUFFER_BYTES, YIELD_THRESHOLD_BYTES)
}

impl<T, U> TonicCodec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}
