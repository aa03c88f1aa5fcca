// The CUDA decode GEMV's launch heuristic (ffi/include/jax_fp4/gemv_config.h), checked on the host:
// the compile-time picks below, then invariants over a grid of shapes and SM counts against a
// plain re-statement of the rules, the H200's measured picks, monotonicity in the SM count, and
// degenerate inputs. Built and run by tests/test_gemv_config.py with each C++ compiler at hand.
// Prints the number of failed checks (each one also on stderr); exits 1 if there are any.
//
// The heuristic takes the resident warps per SM of each kernel instance as an input (the launcher
// asks the CUDA occupancy API); the checks use the values it returns on an H100 / H200 for the
// sm_90a build (kH200ResidentWarps), where the picks were measured.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "jax_fp4/gemv_config.h"

namespace {

using jax_fp4::GemvLaunchConfig;
using jax_fp4::GemvResidentWarps;

// Warps per SM on an H100 / H200 (sm_90a build, bf16 and fp16): one tile 93-96 registers -> 20;
// two column tiles, two row tiles, or both on the tiled layout (121-128) -> 16; both on the spec
// layout (161-168) -> 12.
constexpr GemvResidentWarps kH200ResidentWarps(bool tiled) {
  return GemvResidentWarps{20, 16, 16, tiled ? 16 : 12};
}

constexpr GemvLaunchConfig Config(int64_t m, int64_t n, int64_t k, int64_t sms = 132,
                                  bool tiled = true) {
  return jax_fp4::gemv_launch_config(m, n, k, sms, tiled, kH200ResidentWarps(tiled));
}

// Compile-time checks of the H200 (132 SMs) picks quoted in gemv_config.h.
static_assert(Config(1, 11008, 4096).col_tiles == 2, "");
static_assert(Config(1, 11008, 4096).k_split == 4, "");
static_assert(Config(1, 17408, 5120).col_tiles == 1, "");
static_assert(Config(1, 17408, 5120).k_split == 2, "");
static_assert(Config(8, 17408, 5120).col_tiles == 2, "");
static_assert(Config(1, 5120, 17408).k_split == 6, "");
static_assert(Config(4, 28672, 8192).k_split == 2, "");
static_assert(Config(4, 248320, 2048).col_tiles == 2, "");
static_assert(Config(4, 248320, 2048).k_split == 1, "");
static_assert(Config(4, 11008, 4096).rows_per_block == 4, "");
static_assert(Config(16, 11008, 4096).row_tiles == 2, "");
static_assert(Config(16, 11008, 4096).col_tiles == 2, "");
static_assert(Config(16, 11008, 4096).k_split == 4, "");
static_assert(Config(16, 4096, 11008).col_tiles == 2, "");
static_assert(Config(16, 4096, 11008).k_split == 8, "");
static_assert(Config(24, 2048, 16384).col_tiles == 2, "");
static_assert(Config(24, 1024, 16384).col_tiles == 1, "");
static_assert(Config(16, 28672, 8192).k_split == 2, "");
static_assert(Config(16, 17408, 5120).k_split == 3, "");
// The spec layout's two-by-two config: 12 warps per SM, blocks of at most 4 warps.
static_assert(Config(16, 28672, 8192, 132, false).k_split == 3, "");
static_assert(Config(16, 17408, 5120, 132, false).k_split == 2, "");
static_assert(Config(16, 4096, 11008, 132, false).col_tiles == 1, "");
static_assert(Config(4, 1000, 4096).rows_per_block == 1, "");
static_assert(Config(8, 2048, 2048).k_split == 8, "");
// 24576x4096 (a fused gate/up projection): one tile would need k_split 1 to fit a wave.
static_assert(Config(1, 24576, 4096).col_tiles == 2, "");
static_assert(Config(1, 24576, 4096).k_split == 2, "");

int failures = 0;

void Check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

std::string Describe(int64_t m, int64_t n, int64_t k, int64_t sms, bool tiled,
                     const GemvLaunchConfig& c) {
  return "m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
         " sms=" + std::to_string(sms) + " tiled=" + std::to_string(tiled) +
         ": col_tiles=" + std::to_string(c.col_tiles) +
         " row_tiles=" + std::to_string(c.row_tiles) + " k_split=" + std::to_string(c.k_split) +
         " rows_per_block=" + std::to_string(c.rows_per_block);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- the rules, restated plainly ----------------------------------------------------------------

constexpr int kMaxWarpsPerBlock = 16;
constexpr int kSplits[] = {1, 2, 3, 4, 6, 8};
constexpr int kTwoTileBlocksPerSm = 4;
constexpr int64_t kBlockOverheadWindows = 5;

bool SpecTwoByTwo(int col_tiles, int row_tiles, bool tiled) {
  return col_tiles == 2 && row_tiles == 2 && !tiled;
}

// Warps per SM of the mma kernel at its register count (kH200ResidentWarps).
int ResidentWarps(int col_tiles, int row_tiles, bool tiled) {
  if (SpecTwoByTwo(col_tiles, row_tiles, tiled)) return 12;
  return col_tiles == 1 && row_tiles == 1 ? 20 : 16;
}

int MaxSplit(int col_tiles, int row_tiles, bool tiled) {
  return SpecTwoByTwo(col_tiles, row_tiles, tiled) ? 4 : kMaxWarpsPerBlock / col_tiles;
}

struct Shape {
  int col_tiles, row_tiles;
  bool tiled;
};

int64_t GridBlocks(const Shape& c, int64_t m, int64_t n) {
  return CeilDiv(CeilDiv(n, 16), c.col_tiles) * CeilDiv(std::max<int64_t>(m, 1), 8 * c.row_tiles);
}

bool FitsOneWave(const Shape& c, int64_t m, int64_t n, int k_split, int64_t sms) {
  const int warps = ResidentWarps(c.col_tiles, c.row_tiles, c.tiled);
  return GridBlocks(c, m, n) <= sms * (warps / k_split);
}

// 1 always; more only within the block's warp budget and with two windows per warp.
bool SplitAllowed(const Shape& c, int64_t k, int k_split) {
  return k_split == 1 ||
         (k_split <= MaxSplit(c.col_tiles, c.row_tiles, c.tiled) && 2 * k_split <= k / 128);
}

// An allowed k_split whose grid fits one wave (the column-tile rule asks it of k_split > 1:
// whether one tile splits K).
bool AllowedOneWave(const Shape& c, int64_t m, int64_t n, int64_t k, int k_split, int64_t sms) {
  return SplitAllowed(c, k, k_split) && FitsOneWave(c, m, n, k_split, sms);
}

// The heuristic's cost of a k_split: waves of resident blocks x (windows per warp + 5), then the
// waves (the tie-break).
std::pair<int64_t, int64_t> ModelledTime(const Shape& c, int64_t m, int64_t n, int64_t k,
                                         int k_split, int64_t sms) {
  const int64_t per_sm = ResidentWarps(c.col_tiles, c.row_tiles, c.tiled) / k_split;
  const int64_t rounds = CeilDiv(GridBlocks(c, m, n), sms * per_sm);
  return {rounds * (CeilDiv(k / 128, k_split) + kBlockOverheadWindows), rounds};
}

void TestInvariants() {
  const int64_t ms[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 64, 1000};
  const int64_t ns[] = {1,    7,     16,    100,   1000,  1056,  4096,  5120,
                        8448, 11008, 16896, 17408, 24576, 28672, 248320};
  const int64_t ks[] = {0, 32, 96, 128, 256, 512, 1536, 2048, 4096, 5120, 16384, 17408};
  const int64_t sms_values[] = {1, 2, 46, 108, 132, 170};
  for (const bool tiled : {true, false}) {
    for (const int64_t sms : sms_values) {
      for (const int64_t m : ms) {
        for (const int64_t n : ns) {
          for (const int64_t k : ks) {
            const GemvLaunchConfig c = Config(m, n, k, sms, tiled);
            const std::string where = Describe(m, n, k, sms, tiled, c);
            const int ct = c.col_tiles, ks_ = c.k_split, rows = c.rows_per_block;
            const Shape shape{ct, c.row_tiles, tiled};
            Check(ct == 1 || ct == 2, where);
            // Two 8-row tiles per warp exactly when M > 8.
            Check(c.row_tiles == (m > 8 ? 2 : 1), where);
            Check(std::find(std::begin(kSplits), std::end(kSplits), ks_) != std::end(kSplits) &&
                      ks_ <= MaxSplit(ct, c.row_tiles, tiled),
                  where);
            Check(rows == 1 || rows == 2 || rows == 4, where);
            const int64_t windows = k / 128;
            if (ks_ > 1) Check(windows >= 2 * ks_, "every split warp keeps >= 2 windows: " + where);
            // The split of least modelled time (fewer waves on a tie).
            std::vector<int> candidates;
            for (const int s : kSplits) {
              if (SplitAllowed(shape, k, s)) candidates.push_back(s);
            }
            Check(std::find(candidates.begin(), candidates.end(), ks_) != candidates.end(), where);
            std::pair<int64_t, int64_t> best = ModelledTime(shape, m, n, k, candidates[0], sms);
            for (const int s : candidates)
              best = std::min(best, ModelledTime(shape, m, n, k, s, sms));
            Check(ModelledTime(shape, m, n, k, ks_, sms) == best, "least modelled time: " + where);
            // Prepacked at M > 8: two column tiles wherever their grid (both axes: 16 rows of M a
            // block row) has a block for every other SM. Otherwise two only when their grid still
            // has two waves of blocks; not at M <= 4 when it is just over one wave of k_split-4
            // blocks (by less than half a wave), unless one tile would not split K there.
            const int64_t blocks2 = CeilDiv(CeilDiv(n, 16), 2);
            const int64_t wave = kTwoTileBlocksPerSm * sms;
            const bool thin = m <= 4 && wave < blocks2 && 2 * blocks2 < 3 * wave;
            const Shape one_tile{1, 1, tiled};
            bool one_tile_splits = false;
            for (const int s : kSplits) {
              if (s > 1 && AllowedOneWave(one_tile, m, n, k, s, sms)) one_tile_splits = true;
            }
            if (tiled && m > 8) {
              Check(ct == (2 * blocks2 * CeilDiv(m, 16) >= sms ? 2 : 1), where);
            } else if (ct == 2) {
              Check(blocks2 >= 2 * sms, where);
              Check(!(thin && one_tile_splits), where);
            } else if (blocks2 >= 2 * sms) {
              Check(thin && one_tile_splits && ks_ > 1, where);
            }
            if (m == 1) Check(rows == 1, where);
            Check(rows <= std::max<int64_t>(1, m >= 3 ? 4 : m), where);
            // Row tiling only when the column grid ceil(N / 8) covers a wave on its own.
            if (CeilDiv(n, 8) < sms) Check(rows == 1, where);
            // A call that fixes the heuristic's col_tiles gets the heuristic's k_split.
            Check(jax_fp4::gemv_mma_split(m, n, k, sms, tiled, kH200ResidentWarps(tiled), ct,
                                          c.row_tiles) == ks_,
                  "gemv_mma_split agrees: " + where);
          }
        }
      }
    }
  }
}

// The picks the H200 measured best (benchmarks/RESULTS.md): (col_tiles, k_split) and, where
// given, rows_per_block.
void ExpectPick(int64_t m, int64_t n, int64_t k, int col_tiles, int k_split, bool tiled = true,
                int rows_per_block = 0) {
  const GemvLaunchConfig c = Config(m, n, k, 132, tiled);
  Check(c.col_tiles == col_tiles && c.k_split == k_split &&
            (rows_per_block == 0 || c.rows_per_block == rows_per_block),
        "H200 pick (" + std::to_string(col_tiles) + ", " + std::to_string(k_split) +
            (rows_per_block ? ", " + std::to_string(rows_per_block) : std::string()) +
            ") expected: " + Describe(m, n, k, 132, tiled, c));
}

bool Same(const GemvLaunchConfig& a, const GemvLaunchConfig& b) {
  return a.col_tiles == b.col_tiles && a.row_tiles == b.row_tiles && a.k_split == b.k_split &&
         a.rows_per_block == b.rows_per_block;
}

void TestH200Shapes() {
  for (const int64_t m : {1, 2, 4, 8}) {  // M <= 8: the layouts agree
    Check(Same(Config(m, 11008, 4096, 132, false), Config(m, 11008, 4096, 132, true)),
          "layouts agree at M <= 8: m=" + std::to_string(m));
  }
  for (const int64_t m : {1, 2, 4, 8}) {
    ExpectPick(m, 11008, 4096, 2, 4);   // MLP up/gate: two tiles share activations
    ExpectPick(m, 4096, 11008, 1, 8);   // MLP down
    ExpectPick(m, 5120, 17408, 1, 6);   // 8 would need 1.2 waves of 8-warp blocks
    ExpectPick(m, 28672, 8192, 2, 2);   // 4 would need 1.7 waves
    ExpectPick(m, 248320, 2048, 2, 1);  // lm_head: many waves at any split
    ExpectPick(m, 4096, 4096, 1, 8);
  }
  for (const int64_t m : {1, 2, 4}) ExpectPick(m, 17408, 5120, 1, 2);  // two tiles just over a wave
  ExpectPick(8, 17408, 5120, 2, 3);
  ExpectPick(1, 24576, 4096, 2, 2);           // one tile would fit a wave only at k_split 1
  ExpectPick(4, 11008, 4096, 2, 4, true, 4);  // speculative decode, 4 rows (scalar row tiling 4)
  ExpectPick(8, 2048, 2048, 1, 8, true, 4);   // small MLP: split K for parallelism (2 windows each)
  ExpectPick(1, 100, 128, 1, 1, true, 1);     // one window: nothing to split
  for (const int64_t m : {9, 12, 16}) {       // one pass over the weight for up to 16 rows
    Check(Config(m, 11008, 4096).row_tiles == 2, "two row tiles at m=" + std::to_string(m));
    // Prepacked (activations just in time, 16 warps per SM): the fastest config of every k_split
    // on all eight shapes measured.
    ExpectPick(m, 11008, 4096, 2, 4);
    ExpectPick(m, 28672, 8192, 2, 2);
    ExpectPick(m, 17408, 5120, 2, 3);
    ExpectPick(m, 24576, 4096, 2, 2);
    ExpectPick(m, 4096, 11008, 2, 8);
    ExpectPick(m, 6144, 4096, 2, 8);
    ExpectPick(m, 4096, 4096, 2, 8);
    ExpectPick(m, 248320, 2048, 2, 1);
    // Spec layout (both register buffers, 12 warps per SM).
    ExpectPick(m, 11008, 4096, 2, 4, false);
    ExpectPick(m, 28672, 8192, 2, 3, false);  // 1.7 waves beat the one-wave k_split 1
    ExpectPick(m, 17408, 5120, 2, 2, false);
    ExpectPick(m, 24576, 4096, 2, 2, false);
    ExpectPick(m, 4096, 11008, 1, 8, false);  // too few two-tile blocks
    ExpectPick(m, 6144, 4096, 1, 4, false);
  }
  // M = 17-48 prepacked, where gridDim.y holds blocks too (measured on an H100, 132 SMs like the
  // H200): two tiles on 2048-row weights, 1-27% faster than one.
  for (const int64_t m : {17, 24, 32, 48}) {
    ExpectPick(m, 2048, 16384, 2, 8);
    ExpectPick(m, 2048, 8192, 2, 8);
  }
  for (const int64_t m : {17, 24, 32}) ExpectPick(m, 1024, 16384, 1, 8);  // 64 two-tile blocks
  ExpectPick(48, 1024, 16384, 2, 8);  // 96 two-tile blocks: 19.2 against 23.3 us
  ExpectPick(1, 24576, 8192, 2, 2);   // k_split 8 in three waves measured 6% slower
  ExpectPick(1, 151936, 4096, 2, 2);  // lm_head of the decode step: 97.6 us, 1: 100.0
}

// More SMs never means fewer warps in flight, for a given number of column tiles (at M = 1 the
// choice between one and two tiles also depends on how the two-tile grid fills its waves).
void TestMonotoneInSms() {
  for (const int64_t m : {1, 4, 8, 16}) {
    for (const int64_t n : {1000, 11008, 248320}) {
      for (const int64_t k : {512, 4096}) {
        std::vector<int64_t> warps[3];
        for (const int64_t sms : {16, 64, 132, 264}) {
          const GemvLaunchConfig c = Config(m, n, k, sms);
          warps[c.col_tiles].push_back(CeilDiv(CeilDiv(n, 16), c.col_tiles) * c.k_split);
        }
        for (const auto& counts : warps) {
          Check(std::is_sorted(counts.begin(), counts.end()),
                "monotone in SMs: m=" + std::to_string(m) + " n=" + std::to_string(n) +
                    " k=" + std::to_string(k));
        }
      }
    }
  }
}

void TestDegenerateInputs() {
  const int64_t cases[][4] = {
      {0, 0, 0, 0}, {1, 0, 128, 132}, {1, 1, 0, 132}, {1, 1, 128, -3}, {9, 1, 128, 132}};
  for (const auto& args : cases) {
    for (const bool tiled : {true, false}) {
      const GemvLaunchConfig c = Config(args[0], args[1], args[2], args[3], tiled);
      Check(c.col_tiles >= 1 && c.k_split >= 1 && c.rows_per_block >= 1,
            "degenerate: " + Describe(args[0], args[1], args[2], args[3], tiled, c));
    }
  }
  // Resident warps the occupancy query could not give (0) still give a valid config.
  const GemvLaunchConfig c =
      jax_fp4::gemv_launch_config(16, 11008, 4096, 132, true, GemvResidentWarps{0, 0, 0, 0});
  Check(c.col_tiles >= 1 && c.k_split >= 1 && c.rows_per_block >= 1, "zero resident warps");
}

// The resident warps are an input: fewer of them (a device or build with more registers per
// thread) never put more blocks in one wave, so the pick's k_split never grows.
void TestResidentWarpsInput() {
  for (const int64_t n : {4096, 11008, 28672}) {
    for (const int64_t m : {1, 16}) {
      const GemvLaunchConfig h200 = Config(m, n, 4096, 132, true);
      const int split_fewer = jax_fp4::gemv_mma_split(
          m, n, 4096, 132, true, GemvResidentWarps{10, 8, 8, 8}, h200.col_tiles, h200.row_tiles);
      Check(split_fewer <= h200.k_split,
            "fewer resident warps: m=" + std::to_string(m) + " n=" + std::to_string(n));
    }
  }
}

}  // namespace

int main() {
  TestInvariants();
  TestH200Shapes();
  TestMonotoneInSms();
  TestDegenerateInputs();
  TestResidentWarpsInput();
  std::printf("%d\n", failures);
  return failures != 0;
}
