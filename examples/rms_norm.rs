//! rms_norm from Rust alone: on the CPU always, on the GPU when one is present.
//!
//! `cargo run --release --example rms_norm`
use keel::cpu::Par;
use keel::ops::rms_norm;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (rows, cols) = (4, 8);
    let x: Vec<f32> = (0..rows * cols).map(|i| i as f32 / 10.0 - 1.0).collect();
    let w = vec![1.5f32; cols];

    let mut y = vec![0f32; rows * cols];
    rms_norm::forward_cpu(&x, Some(&w), &mut y, cols, 1e-6, Par::Rayon)?;
    println!("CPU: first row {:?}", &y[..cols]);

    if !keel::cuda::is_available() {
        let why = keel::cuda::device_count().err().map_or("no CUDA device".to_string(), |e| e.to_string());
        println!("GPU: skipped ({why})");
        return Ok(());
    }
    let stream = keel::cuda::gpu(0)?.new_stream()?;
    let xd = stream.clone_htod(&x)?;
    let wd = stream.clone_htod(&w)?;
    let mut yd = stream.alloc_zeros::<f32>(rows * cols)?;
    rms_norm::forward_cuda(&stream, &xd, Some(&wd), &mut yd, cols, 1e-6)?;
    let y_gpu = stream.clone_dtoh(&yd)?;
    let max_diff = y.iter().zip(&y_gpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    println!("GPU: first row {:?} (max |GPU - CPU| = {max_diff:e})", &y_gpu[..cols]);
    Ok(())
}
