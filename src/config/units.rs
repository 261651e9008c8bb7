//! Durations (`500ms`, `5s`, `1m`) and sizes (`8MiB`) as options write them, both ways:
//! what `format_*` writes, `parse_*` reads back exactly.

use std::time::Duration;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// The longest duration an option accepts.
const MAX_DURATION: Duration = Duration::from_secs(86_400 * 365);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UnitError {
    #[error("expected a duration like 5s, got {0:?}")]
    NotADuration(String),
    #[error("expected a size like 8MiB, got {0:?}")]
    NotASize(String),
    #[error("unknown unit {0:?}")]
    UnknownUnit(String),
    #[error("out of range")]
    DurationOutOfRange,
    #[error("too large")]
    SizeTooLarge,
}

/// `5`, `1.5`, `500ms`, `2s`, `1m`, `1h`, `7d`; plain numbers are seconds. Decimal fractions are
/// exact to the nanosecond (no floating point), so a formatted duration reads back equal.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let (num, unit) = split_unit(text);
    let not_a_duration = || UnitError::NotADuration(text.to_string());
    let (whole, fraction) = num.split_once('.').unwrap_or((num, ""));
    let digits_only = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (whole.is_empty() && fraction.is_empty()) || !digits_only(whole) || !digits_only(fraction) {
        return Err(not_a_duration());
    }
    let nanos_per_unit: u128 = match unit {
        "" | "s" => 1_000_000_000,
        "ms" => 1_000_000,
        "m" | "min" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        "d" => 86_400_000_000_000,
        _ => return Err(UnitError::UnknownUnit(unit.to_string())),
    };
    // The number in units of 10^-9, digits below that dropped.
    let whole: u128 = match whole {
        "" => 0,
        w => w.parse().map_err(|_| UnitError::DurationOutOfRange)?,
    };
    let fraction_digits = &fraction[..fraction.len().min(9)];
    let fraction_nanos: u128 = format!("{fraction_digits:0<9}")
        .parse()
        .map_err(|_| not_a_duration())?;
    let nanos = whole
        .checked_mul(1_000_000_000)
        .and_then(|n| n.checked_add(fraction_nanos))
        .and_then(|n| n.checked_mul(nanos_per_unit))
        .map(|n| n / 1_000_000_000)
        .ok_or(UnitError::DurationOutOfRange)?;
    if nanos > MAX_DURATION.as_nanos() {
        return Err(UnitError::DurationOutOfRange);
    }
    let nanos = nanos as u64; // At most a year: fits.
    Ok(Duration::from_nanos(nanos))
}

/// The shortest of `2s`, `500ms` or `1.000000001s` that [`parse_duration`] reads back equal.
pub fn format_duration(d: Duration) -> String {
    let (secs, nanos) = (d.as_secs(), d.subsec_nanos());
    if nanos == 0 {
        format!("{secs}s")
    } else if nanos % 1_000_000 == 0 {
        format!("{}ms", d.as_millis())
    } else {
        let fraction = format!("{nanos:09}");
        format!("{secs}.{}s", fraction.trim_end_matches('0'))
    }
}

/// `8388608`, `8M`, `8MiB`, `1G`...; binary units.
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let (num, unit) = split_unit(text);
    let n: u64 = num
        .parse()
        .map_err(|_| UnitError::NotASize(text.to_string()))?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => GIB,
        _ => return Err(UnitError::UnknownUnit(unit.to_string())),
    };
    n.checked_mul(mult).ok_or(UnitError::SizeTooLarge)
}

/// `8MiB`, `1GiB`, `4KiB`, or plain bytes: the largest unit that divides the size.
pub fn format_size(bytes: u64) -> String {
    match bytes {
        0 => "0".to_string(),
        b if b % GIB == 0 => format!("{}GiB", b / GIB),
        b if b % MIB == 0 => format!("{}MiB", b / MIB),
        b if b % KIB == 0 => format!("{}KiB", b / KIB),
        b => b.to_string(),
    }
}

fn split_unit(v: &str) -> (&str, &str) {
    let v = v.trim();
    let i = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    (&v[..i], v[i..].trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("8M").unwrap(), 8 * MIB);
        assert_eq!(parse_size("1GiB").unwrap(), GIB);
        assert_eq!(
            parse_size("99999999999999999999G"),
            Err(UnitError::NotASize("99999999999999999999G".into()))
        );
        assert_eq!(parse_size("99999999999G"), Err(UnitError::SizeTooLarge));
        assert_eq!(parse_size("1.5M"), Err(UnitError::NotASize("1.5M".into())));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration(".5s").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("5.").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration(" 2s ").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("0.1").unwrap(), Duration::from_millis(100));
        assert_eq!(
            parse_duration("1.5ms").unwrap(),
            Duration::from_micros(1500)
        );
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(parse_duration("366d"), Err(UnitError::DurationOutOfRange));
        assert_eq!(
            parse_duration("2w"),
            Err(UnitError::UnknownUnit("w".into()))
        );
        assert_eq!(
            parse_duration("8760h").unwrap(),
            Duration::from_secs(86_400 * 365)
        );
        assert_eq!(parse_duration("8761h"), Err(UnitError::DurationOutOfRange));
        assert_eq!(
            parse_duration(&"9".repeat(400)),
            Err(UnitError::DurationOutOfRange)
        );
        for bad in ["-1", "", ".", "1.2.3", "NaN", "1e3"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn formatted_values_read_back_equal() {
        for d in [
            Duration::ZERO,
            Duration::from_secs(5),
            Duration::from_millis(500),
            Duration::from_millis(1500),
            Duration::from_nanos(1),
            Duration::from_nanos(1_000_000_001),
            Duration::from_micros(2500),
            MAX_DURATION,
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{d:?}");
        }
        assert_eq!(format_duration(Duration::from_secs(5)), "5s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        for size in [0, 1, 5 * MIB + 1, 8 * MIB, 3 * KIB, 5 * GIB, u64::MAX] {
            assert_eq!(parse_size(&format_size(size)), Ok(size), "{size}");
        }
        assert_eq!(format_size(512 * MIB), "512MiB");
    }
}
