//! Byte counts for people: the workspace's one formatter (CLI summaries,
//! `kt status`, scenario step descriptions, bench tables, the store's
//! "store full" error). Binary units, two decimals once a prefix applies:
//! `900 B`, `1.46 KiB`, `16.00 MiB`, `1.00 GiB` (the format of indicatif's
//! `BinaryBytes`, which the scenario snapshots already hold).
//! Parsing is [`kt_client::size::parse`]'s (one grammar, in the client crate).

/// `bytes` in binary units: `12 B`, `1.50 KiB`, `16.00 MiB`.
pub fn human(bytes: u64) -> String {
    const PREFIXES: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let mut v = bytes as f64;
    let mut prefix = None;
    for p in PREFIXES {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        prefix = Some(p);
    }
    match prefix {
        None => format!("{bytes} B"),
        Some(p) => format!("{v:.2} {p}B"),
    }
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn bytes_show_in_binary_units_with_two_decimals() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1024), "1.00 KiB");
        assert_eq!(human(1_500), "1.46 KiB");
        assert_eq!(human(16 << 20), "16.00 MiB");
        assert_eq!(human(1_500_000_000), "1.40 GiB");
        assert_eq!(human(1_500_000_000_000_000), "1.33 PiB");
        assert_eq!(human(u64::MAX), "16.00 EiB");
    }
}
