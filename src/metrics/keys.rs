//! Keys built at compile time for the events of every request, so that recording one does
//! not build (and allocate) its key each time; rarer events use the facade's macros.

use ::metrics::{Key, Label, Level, Metadata};

pub(super) static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// `(value, key)` for each value of one label of one metric.
macro_rules! labelled {
    ($name:expr, $label:literal, [$($value:expr),* $(,)?]) => {
        [$(($value, {
            static LABELS: [Label; 1] = [Label::from_static_parts($label, $value)];
            Key::from_static_parts($name, &LABELS)
        })),*]
    };
}

/// The request counter, by `outcome`.
pub(super) static OUTCOMES: [(&str, Key); 6] = labelled!(
    super::REQUESTS,
    "outcome",
    [
        super::EXECUTED,
        super::REPLAYED,
        super::KEY_REUSED,
        super::IN_PROGRESS,
        super::BUSY,
        super::STORE_UNAVAILABLE,
    ]
);

/// The store latency histogram, by `operation`: the operations the engine times.
pub(super) static OPERATIONS: [(&str, Key); 4] = labelled!(
    super::STORE_SECONDS,
    "operation",
    ["claim", "lookup", "complete", "release"]
);

pub(super) static CLAIMS_IN_FLIGHT: Key = Key::from_static_name(super::CLAIMS_IN_FLIGHT);

/// Where `value` is in `keys`, if it is there.
pub(super) fn index(keys: &[(&str, Key)], value: &str) -> Option<usize> {
    keys.iter().position(|(known, _)| *known == value)
}
