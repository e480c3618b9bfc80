// SPDX-License-Identifier: BSD-3-Clause
// Tuning: every override of the launch policy in one struct. The planner (group_norm_plan.h) reads it as an
// argument; nothing else reads the environment. The process-wide value is read once from GNEXT_* environment
// variables, on first use, and can be replaced at run time (groupnorm_ext.set_tuning, which the tests use).
// The defaults are the planner's rules; the overrides exist for measurements and for tests that force a kernel.
// `python -m groupnorm_ext --info` lists them with their current values (kTuningFields; docs/development.md).
#pragma once
#include <cstdlib>
#include <mutex>

namespace gnext {
namespace gn {

constexpr int kRule = -1;  // a field at kRule follows the planner's rule

struct Tuning {
  int bulk = 1;                // 0: never the bulk forward; 1: the rule; 2: wherever it fits
  int bulk_bwd = 1;            // the same for the bulk backward
  int bulk_ahead = kRule;      // bulk look-ahead in groups (forward 1-4, backward 0-4); rule: the most the ring holds
  int bulk_consumers = kRule;  // bulk consumer warps (forward 1-16, backward at most 8); rule: bulk_forward_geometry
  int bulk_hold = kRule;       // bulk, streamed: chunks of a slice kept in shared memory, the rest read again from L2
  int bulk_pace = kRule;       // bulk producer: 0 counts stages up, 1 computes each chunk's stage; rule: 0 only for the forward >= 3.8 TB/s
  int bulk_chunk = kRule;      // bulk forward copy bytes, 4096, 8192 or 16384 (4 KiB per consumer warp)
  int bulk_nhwc = 1;           // channels_last bulk forward (sm_90+): 0 never, 1 the rule, 2 wherever it fits
  int bulk_teams = kRule;      // bulk forward teams of CTAs, each on its own groups: 1 one team; rule: the fewest whose slices are long enough
  int onepass = 1;             // 0: never the one-pass kernels; 1: the rule; 2: wherever they fit
  int onepass_ctas = kRule;    // one-pass CTAs per SM (1-4); rule: 2, or 4 for many small NCHW groups
  int onepass_nbuf = 2;        // one-pass shared-memory stages (2-4)
  int onepass_early = kRule;   // one-pass publish order: 1 early, 0 late; rule: early when T > 1
  int onepass_pack = 1;        // 0: no re-plan with more CTAs per SM for streamed NCHW tiles
  int ragged_small = kRule;    // bytes under which tiny ragged tensors take the one-pass kernel; rule: 1 MiB
  int target_ctas = kRule;     // CTAs per two-pass launch; rule: 4 per SM
  int chunk_align = 64;        // NCHW chunk alignment of the two-pass kernels, in vectors
  int affine_tile = kRule;     // NCHW elementwise pass, long rows: 1 a CTA per tile of threads x 4 vectors, 0 CTAs looping over chunks
  int affine_k = kRule;        // NCHW elementwise pass, looping CTAs: chunks per row (rule: affine_loop_chunks)
  int nhwc_min_rows = kRule;   // NHWC two-pass chunk floor in rows (0: the plain split)
  int small = 1;               // 0: never the small-group kernels
  int small_cta = 2;           // CTA-per-group small kernels: 0 never, 1 backward only, 2 both
  int small_cta_min = 1;       // ... where N*G >= this many groups per SM
  int small_fill = 2;          // small-group grid fill, CTAs per SM (0: off)
  int small_kreg = 0;          // 8: 8 vector registers per lane in every warp plan
  int wide = 1;                // NCHW wide kernels: 0 never, 1 the rule, 2 wherever they fit
  int wide_held = kRule;       // cap on the wide kernels' shared memory per CTA and buffer, bytes
  int wide_ahead = 1;          // 0: no look-ahead buffer in the wide forward
  int wide_nhwc = 1;           // channels_last wide forward: 0 never, 1 the rule, 2 wherever it fits
  int dy_nchw = 1;             // 0: copy an NCHW grad_out of a channels_last input instead of reading it in place
  int pdl = 1;                 // 0: plain launches instead of programmatic dependent launches
  int pad_rows = kRule;        // padded output's row kernel: rows per warp trip (1 or 2), their loads in flight together
  int pad_tile = kRule;        // padded output: 0 never the tile kernel, 1 rule, 2 wherever its rows fit
};

struct TuningField {
  const char* env;  // environment variable
  int Tuning::*field;
  const char* doc;
};
inline constexpr TuningField kTuningFields[] = {
    {"GNEXT_BULK", &Tuning::bulk, "bulk NCHW forward (sm_90+): 0 never, 1 rule, 2 wherever it fits"},
    {"GNEXT_BULK_BWD", &Tuning::bulk_bwd, "bulk NCHW backward (sm_90+): 0 never, 1 rule, 2 wherever it fits"},
    {"GNEXT_BULK_AHEAD", &Tuning::bulk_ahead, "bulk look-ahead in groups: forward 1-4, backward 0-4 (rule: the most that fits)"},
    {"GNEXT_BULK_CONSUMERS", &Tuning::bulk_consumers, "bulk consumer warps: forward 1-16, backward 1-8 (rule: the most; on >= 3.8 TB/s 12 for held NCHW slices of 17-24 parts of 4 KiB)"},
    {"GNEXT_BULK_HOLD", &Tuning::bulk_hold, "bulk: chunks per slice kept in shared memory, the rest read again from L2 (rule: where the ring does not hold two slices)"},
    {"GNEXT_BULK_PACE", &Tuning::bulk_pace, "bulk producer loop: 0 counts stages up, 1 computes each chunk's stage before its wait (rule: 0 only for the forward on >= 3.8 TB/s)"},
    {"GNEXT_BULK_CHUNK", &Tuning::bulk_chunk, "bulk forward copy size in bytes, 4096, 8192 or 16384: a consumer warp per 4 KiB (rule: 16384 on >= 3.8 TB/s, 8192 there for streamed slices, else 4096)"},
    {"GNEXT_BULK_TEAMS", &Tuning::bulk_teams, "bulk forward: teams of CTAs, each on its own groups (1: one team of every CTA; rule: the fewest teams of >= 4 CTAs whose slices reach the bulk forward's length, where one team's do not)"},
    {"GNEXT_BULK_NHWC", &Tuning::bulk_nhwc, "channels_last bulk forward (sm_90+): 0 never, 1 rule, 2 wherever it fits"},
    {"GNEXT_ONEPASS", &Tuning::onepass, "one-pass kernels: 0 never, 1 rule, 2 wherever they fit"},
    {"GNEXT_ONEPASS_CTAS", &Tuning::onepass_ctas, "one-pass CTAs per SM, 1-4 (rule: 2; 4 for many small groups)"},
    {"GNEXT_ONEPASS_NBUF", &Tuning::onepass_nbuf, "one-pass shared-memory stages, 2-4"},
    {"GNEXT_ONEPASS_EARLY", &Tuning::onepass_early, "one-pass publish order: 1 early, 0 late (rule: early if T > 1)"},
    {"GNEXT_ONEPASS_PACK", &Tuning::onepass_pack, "0: no re-plan at more CTAs per SM for streamed tiles"},
    {"GNEXT_RAGGED_SMALL", &Tuning::ragged_small, "bytes of a tensor whose tiny ragged groups take one-pass (rule: 1 MiB)"},
    {"GNEXT_TARGET_CTAS", &Tuning::target_ctas, "CTAs per two-pass launch (rule: 4 per SM)"},
    {"GNEXT_CHUNK_ALIGN", &Tuning::chunk_align, "two-pass NCHW chunk alignment, in 16-byte vectors"},
    {"GNEXT_AFFINE_TILE", &Tuning::affine_tile, "two-pass NCHW elementwise pass over long rows: 1 a CTA per tile of 2048 vectors, 0 CTAs looping over chunks (rule: tiles, except the 2-byte GELU forwards on >= 3.8 TB/s)"},
    {"GNEXT_AFFINE_K", &Tuning::affine_k, "two-pass NCHW elementwise pass, looping CTAs: chunks per row (rule: the fewest from target CTAs up whose last wave of resident CTAs is >= 70% full, or 8 waves)"},
    {"GNEXT_NHWC_MIN_ROWS", &Tuning::nhwc_min_rows, "two-pass NHWC chunk floor in pixel rows, 0: none"},
    {"GNEXT_SMALL", &Tuning::small, "small-group kernels: 0 never"},
    {"GNEXT_SMALL_CTA", &Tuning::small_cta, "CTA-per-group kernels: 0 never, 1 backward only, 2 both"},
    {"GNEXT_SMALL_CTA_MIN", &Tuning::small_cta_min, "CTA-per-group kernels from this many groups per SM"},
    {"GNEXT_SMALL_FILL", &Tuning::small_fill, "small-group grid fill in CTAs per SM, 0 off"},
    {"GNEXT_SMALL_KREG", &Tuning::small_kreg, "8: 8 vector registers per lane in every warp plan"},
    {"GNEXT_WIDE", &Tuning::wide, "NCHW wide kernels: 0 never, 1 rule, 2 wherever they fit"},
    {"GNEXT_WIDE_HELD", &Tuning::wide_held, "cap on the wide kernels' shared memory per buffer, bytes"},
    {"GNEXT_WIDE_AHEAD", &Tuning::wide_ahead, "0: no look-ahead in the wide forward"},
    {"GNEXT_WIDE_NHWC", &Tuning::wide_nhwc, "channels_last wide forward: 0 never, 1 rule, 2 wherever it fits"},
    {"GNEXT_DY_NCHW", &Tuning::dy_nchw, "0: copy an NCHW grad_out of a channels_last input first"},
    {"GNEXT_PDL", &Tuning::pdl, "0: no programmatic dependent launches"},
    {"GNEXT_PAD_ROWS", &Tuning::pad_rows, "padded output (group_norm_act_pad), row kernel: rows per warp trip, 1 or 2, their loads in flight together (rule: 2)"},
    {"GNEXT_PAD_TILE", &Tuning::pad_tile, "padded output (group_norm_act_pad): the tile kernel (source rows staged in shared memory by cp.async); 0 never, 1 rule (rows of 16-byte multiples from 256 elements), 2 wherever the rows fit"},
};

// A Tuning from `lookup(env name)` (null or empty: the default). Unknown names are not looked up.
template <typename Lookup>
Tuning tuning_from(Lookup&& lookup) {
  Tuning t{};
  for (const TuningField& f : kTuningFields)
    if (const char* v = lookup(f.env); v != nullptr && v[0] != '\0') t.*f.field = std::atoi(v);
  return t;
}

namespace detail {
struct TuningState {
  std::once_flag once;
  Tuning value;
};
inline TuningState& tuning_state() {
  static TuningState s;
  return s;
}
}  // namespace detail

// The process-wide tuning: the environment's on first use, or the last set_tuning.
inline const Tuning& tuning() {
  detail::TuningState& s = detail::tuning_state();
  std::call_once(s.once, [&s] { s.value = tuning_from([](const char* n) { return std::getenv(n); }); });
  return s.value;
}
// Replaces it (not while ops run on other threads: the ops read it without a lock).
inline void set_tuning(const Tuning& t) {
  (void)tuning();
  detail::tuning_state().value = t;
}

}  // namespace gn
}  // namespace gnext
