//! Byte sizes as users write them: one grammar for the CLI, the scenario
//! files and the benches, the `parse-size` crate's. `4096`; IEC binary
//! units (`64KiB`, `256MiB`, `1GiB`: powers of 1024); SI decimal units
//! (`1KB`, `1.5GB`: powers of 1000; a bare `K`, `M`, `G` too); units in any
//! case, the `B` optional, `_` grouping digits, fractions rounded to a byte.

/// Parses a byte count, saying what was wrong with it.
pub fn parse(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s.trim())
        .map_err(|e| format!("{s:?} is not a size ({e}; e.g. 4096, 64KiB, 256MiB, 1GB)"))
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn binary_units_are_iec_and_decimal_units_si() {
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse("64KiB"), Ok(64 << 10));
        assert_eq!(parse("256 MiB"), Ok(256 << 20));
        assert_eq!(parse("1gib"), Ok(1 << 30));
        assert_eq!(parse("1kB"), Ok(1_000));
        assert_eq!(parse("1KB"), Ok(1_000));
        assert_eq!(parse("256M"), Ok(256_000_000));
        assert_eq!(parse(" 2 GB "), Ok(2_000_000_000));
        assert_eq!(parse("1.5KiB"), Ok(1536));
        assert_eq!(parse("1_048_576"), Ok(1 << 20));
        assert!(parse("G").is_err());
        assert!(parse("1X").is_err());
        assert!(parse("-1").is_err());
        let e = parse("99999999999TB").unwrap_err();
        assert!(e.contains("is not a size"), "{e}");
    }
}
