//! Sizes as people write them (`4k`, `1.5G`, `64MiB`) and as every message prints them: one
//! parser and one formatter, shared by the engine, the backends and the command line.

/// Binary size units: `4k` = 4096, `1M` = 1 MiB, `2GiB` = 2 GiB, `1.5G` = 1.5 GiB. Plain
/// numbers are bytes. A fraction must come to a whole number of bytes (`0.5k` is 512; `0.1k`
/// is refused).
pub fn parse_size(text: &str) -> Result<u64, SizeParseError> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let error = |reason: &str| SizeParseError {
        text: text.to_string(),
        reason: reason.to_string(),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(error("it does not start with a number"));
    }
    if fraction.contains('.') {
        return Err(error("the number has two decimal points"));
    }
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return Err(error("unknown unit; use k, M, G, T (binary: 1k = 1024)")),
    };
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole
            .parse()
            .map_err(|_| error("the number is too large"))?
    };
    let whole_bytes = whole
        .checked_mul(1u64 << shift)
        .ok_or_else(|| error("the size does not fit in 64 bits"))?;
    if fraction.is_empty() {
        return Ok(whole_bytes);
    }
    // fraction / 10^digits × 2^shift, exactly: at most 18 digits keep 10^digits in a u64, and
    // u128 holds the product.
    let fraction = fraction.trim_end_matches('0');
    if fraction.len() > 18 {
        return Err(error("too many decimal places"));
    }
    let numerator: u128 = if fraction.is_empty() {
        0
    } else {
        fraction
            .parse::<u128>()
            .map_err(|_| error("the fraction is not a number"))?
    };
    let denominator = 10u128.pow(fraction.len() as u32);
    let scaled = numerator << shift;
    if !scaled.is_multiple_of(denominator) {
        return Err(error("the fraction is not a whole number of bytes"));
    }
    u64::try_from(scaled / denominator)
        .ok()
        .and_then(|fraction_bytes| whole_bytes.checked_add(fraction_bytes))
        .ok_or_else(|| error("the size does not fit in 64 bits"))
}

/// Formats a byte count with the largest binary unit that divides it (`64KiB`, `1MiB`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(&str, u32); 5] = [
        ("PiB", 50),
        ("TiB", 40),
        ("GiB", 30),
        ("MiB", 20),
        ("KiB", 10),
    ];
    for (name, shift) in UNITS {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{name}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

/// Formats a measured amount of bytes for people: [`format_size`]'s exact spelling when the
/// largest unit it reaches divides it (`512MiB`), else one decimal in that unit (`73.8MiB`,
/// never `77411736B` or `524292KiB`), so every size a command prints reads the same way,
/// round or not. Below 1 KiB the bytes are whole (`1000B`).
pub fn format_size_rounded(bytes: u64) -> String {
    const UNITS: [(&str, u32); 5] = [
        ("PiB", 50),
        ("TiB", 40),
        ("GiB", 30),
        ("MiB", 20),
        ("KiB", 10),
    ];
    for (name, shift) in UNITS {
        if bytes >= 1 << shift {
            if bytes.is_multiple_of(1 << shift) {
                return format!("{}{name}", bytes >> shift);
            }
            return format!("{:.1}{name}", bytes as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{bytes}B")
}

/// A size that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size `{text}`: {reason}")]
pub struct SizeParseError {
    /// What was given.
    pub text: String,
    /// Why it was refused.
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: sizes read and print in binary units, fractions only when whole bytes. Method:
    /// each spelling against its byte count, and each malformed one refused with its reason.
    #[test]
    fn sizes_use_binary_units() {
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("512").unwrap(), 512);
        assert!(parse_size("k").unwrap_err().to_string().contains("number"));
        assert!(parse_size("4x").unwrap_err().to_string().contains("unit"));
        assert!(parse_size("99999999999P").is_err());
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("0.5k").unwrap(), 512);
        assert_eq!(parse_size(".25M").unwrap(), 1 << 18);
        assert_eq!(parse_size("2.0G").unwrap(), 2 << 30);
        assert!(parse_size("0.1k")
            .unwrap_err()
            .to_string()
            .contains("whole number"));
        assert!(parse_size("1.2.3G").is_err());
        assert!(parse_size(".").is_err());
        assert_eq!(format_size(65536), "64KiB");
        assert_eq!(format_size(1000), "1000B");
    }

    /// Goal: measured amounts print in the largest unit they reach, whole when exact and with
    /// one decimal otherwise, spelled as `format_size` spells them. Method: round and uneven
    /// amounts (the spellings a user met: `77411736B`, `524292KiB`) against their text.
    #[test]
    fn rounded_sizes_use_the_largest_unit_with_one_decimal() {
        assert_eq!(format_size_rounded(77_411_736), "73.8MiB");
        assert_eq!(format_size_rounded(524_292 << 10), "512.0MiB");
        assert_eq!(format_size_rounded(512 << 20), "512MiB");
        assert_eq!(format_size_rounded(3 << 29), "1.5GiB");
        assert_eq!(format_size_rounded(65536), format_size(65536));
        assert_eq!(format_size_rounded(1000), "1000B");
        assert_eq!(format_size_rounded(0), "0B");
        assert_eq!(format_size_rounded(u64::MAX), "16384.0PiB");
    }
}
