//! Byte sizes: parsed with kt's one grammar ([`kt_client::size::parse`]:
//! `1GiB`, `256MiB` binary, `1GB` decimal), shown in binary units.

pub use kt_client::size::parse as parse_size;

/// A byte count for humans, in binary units.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_show_in_binary_units() {
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(12), "12 B");
    }
}
