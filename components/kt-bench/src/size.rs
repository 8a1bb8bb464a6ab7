//! Byte sizes on the command line: `1073741824`, `1G`, `256M`, `512KiB`.

/// Parses a byte count with an optional binary unit suffix (K, M, G, T; `B`,
/// `iB` and case are ignored): `256M` is 256 MiB.
pub fn parse_size(raw: &str) -> Result<u64, String> {
    let s = raw.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "{raw:?} is not a size (expected e.g. 1073741824, 1G, 256M)"
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|e| format!("{raw:?} is not a size: {e}"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "{raw:?}: unknown unit {other:?} (use K, M, G or T, binary)"
            ));
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{raw:?} is too large"))
}

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
    fn parses_sizes() {
        assert_eq!(parse_size("123"), Ok(123));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size(" 2 GB "), Ok(2 << 30));
        assert!(parse_size("G").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(12), "12 B");
    }
}
