//! Byte sizes: parsed with kt's one grammar ([`kt_client::size::parse`]:
//! `1GiB`, `256MiB` binary, `1GB` decimal), shown with kt's one formatter
//! ([`kt_types::size::human`]: `1.00 GiB`, `1.50 KiB`, `12 B`).

pub use kt_client::size::parse as parse_size;
pub use kt_types::size::human;
