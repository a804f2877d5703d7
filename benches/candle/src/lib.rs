//! Nothing here: the comparison is `benches/vs_candle.rs`.
