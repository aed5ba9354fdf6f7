// The speaker page's AudioWorklet: microphone audio (float samples at the AudioContext's
// rate, usually 48 or 44.1 kHz) in, frames of 16-bit mono PCM at 16 kHz out, about 100 ms
// each, posted to the page with their level. Plain JavaScript with no dependency: it runs
// in the browser's audio thread, where nothing can be loaded but this file.
//
// Why downsample here and not let the server do it (it resamples any rate): 16 kHz is
// what the recognizer hears, so a third of the bytes cross the network; and the audio
// thread does it as the samples come, without a copy through the page's main thread.
//
// How: a low-pass filter (windowed sinc, cut at 90% of the output's Nyquist frequency,
// so that nothing above 8 kHz folds into the speech band), then linear interpolation at
// the output's sample times, in the manner of the server's resampler
// (engine/asr/audio.py). The filter runs on every input sample (about 50
// multiply-adds each: nothing for an audio thread) and keeps its state across the
// 128-sample blocks the browser hands over.
"use strict";

const TAPS_PER_RATIO = 8; // half-length of the filter per unit of decimation ratio
const CUTOFF = 0.9; // pass band edge, as a share of the output's Nyquist frequency

class PcmDownsampler extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const settings = (options && options.processorOptions) || {};
    this.targetRate = settings.targetRate || 16000;
    const frameMs = settings.frameMs || 100;
    // `sampleRate` is the AudioContext's rate (a global of the worklet scope).
    this.ratio = sampleRate / this.targetRate; // input samples per output sample
    this.taps = lowPass(this.ratio);
    this.half = (this.taps.length - 1) / 2;
    // The last raw samples the filter still needs (at the start: silence).
    this.raw = new Float32Array(this.taps.length - 1);
    this.filtered = 0; // filtered samples made so far (sample i is centred on input i)
    this.last = 0; // the last filtered sample (interpolation across blocks)
    this.emitted = 0; // output samples made so far
    this.frameLength = Math.round((this.targetRate * frameMs) / 1000);
    this.frame = new Int16Array(this.frameLength);
    this.filled = 0;
    this.running = true;
    this.port.onmessage = (event) => {
      if (event.data === "stop") {
        this.flush();
        this.running = false;
      }
    };
  }

  process(inputs) {
    const input = inputs[0];
    if (!this.running) return false;
    if (!input || input.length === 0 || input[0].length === 0) return true;
    const block = mono(input);
    // raw tail + block, filtered at every position that has a full window.
    const work = new Float32Array(this.raw.length + block.length);
    work.set(this.raw);
    work.set(block, this.raw.length);
    const taps = this.taps;
    const width = taps.length;
    const first = this.filtered; // global index of the first filtered sample below
    const count = work.length - width + 1;
    const filtered = new Float32Array(count);
    for (let i = 0; i < count; i++) {
      let sum = 0;
      for (let k = 0; k < width; k++) sum += work[i + k] * taps[k];
      filtered[i] = sum;
    }
    this.raw = work.slice(work.length - (width - 1));
    this.filtered += count;
    // Output sample m sits at filtered position m * ratio (the filter's delay is the same
    // for every sample, so it shifts the stream, not the spacing).
    for (;;) {
      const position = this.emitted * this.ratio;
      const index = Math.floor(position);
      if (index + 1 > this.filtered - 1) break;
      const a = index < first ? this.last : filtered[index - first];
      const b = filtered[index + 1 - first];
      const value = a + (b - a) * (position - index);
      this.push(value);
      this.emitted += 1;
    }
    this.last = filtered[count - 1];
    return true;
  }

  push(value) {
    const clipped = Math.max(-1, Math.min(1, value));
    this.frame[this.filled++] = Math.round(clipped * 32767);
    if (this.filled === this.frameLength) this.flush();
  }

  // Post the frame (transferred, not copied) with its level, and start a new one.
  flush() {
    if (this.filled === 0) return;
    const pcm = this.filled === this.frameLength ? this.frame : this.frame.slice(0, this.filled);
    let squares = 0;
    let peak = 0;
    for (let i = 0; i < pcm.length; i++) {
      const v = Math.abs(pcm[i]) / 32768;
      squares += v * v;
      if (v > peak) peak = v;
    }
    const rms = Math.sqrt(squares / pcm.length);
    // Transferred: `pcm.buffer` is the page's now (and `this.frame` empty, if it was it).
    this.port.postMessage({ pcm: pcm.buffer, rms, peak }, [pcm.buffer]);
    this.frame = new Int16Array(this.frameLength);
    this.filled = 0;
  }
}

// Average the channels (a microphone may come as stereo).
function mono(input) {
  if (input.length === 1) return input[0];
  const out = new Float32Array(input[0].length);
  for (const channel of input) {
    for (let i = 0; i < out.length; i++) out[i] += channel[i] / input.length;
  }
  return out;
}

// Windowed-sinc low-pass taps (Blackman window), normalised to a gain of 1; a single tap
// (no filtering) when the rate goes up or stays.
function lowPass(ratio) {
  if (ratio <= 1) return new Float32Array([1]);
  const half = Math.ceil(TAPS_PER_RATIO * ratio);
  const cutoff = (CUTOFF * 0.5) / ratio; // cycles per input sample
  const taps = new Float32Array(2 * half + 1);
  let total = 0;
  for (let i = 0; i < taps.length; i++) {
    const k = i - half;
    const x = 2 * Math.PI * cutoff * k;
    const sinc = k === 0 ? 2 * cutoff : Math.sin(x) / (Math.PI * k);
    const w = 0.42 - 0.5 * Math.cos((2 * Math.PI * i) / (taps.length - 1)) +
      0.08 * Math.cos((4 * Math.PI * i) / (taps.length - 1));
    taps[i] = sinc * w;
    total += taps[i];
  }
  for (let i = 0; i < taps.length; i++) taps[i] /= total;
  return taps;
}

registerProcessor("pcm-downsampler", PcmDownsampler);
