"""Launch configuration: the one heuristic that maps a problem to a kernel variant.

``forward_plan`` / ``backward_plan`` take (N, dtypes, vector width, shared-memory limit, largest
thread-block cluster) and return a frozen ``Plan``: which template instantiation, how many
threads per row, how many vectors each thread keeps, block size, dynamic shared memory and
blocks per cluster. They need no GPU (the CPU tests
enumerate every plan they can return and compile it). ``grid_size`` turns a plan and M into a
persistent grid from the kernel's measured occupancy.

Thresholds and why (H200, bf16, M*N = 2**27; scripts/tune.py, data in docs/):
* the row a thread keeps in registers: FWD_REG_ITEMS = 8 vectors in the forward (128 bytes in
  16-byte vectors; 16-bit values stay as loaded, half a register each, so 32 registers for
  every dtype), 16 values in the backward (which keeps x, dy and the dw/db accumulators).
  Forward 16-bit rows in 16-byte vectors measured at 8 vectors against 4 (one run, best of 5):
  bf16 N=768 3914 GB/s against 3584, 1024 3859 / 3729, 5120 3881 / 3589, 8192 3830 / 3702;
  N=512 and 4096 0.8% behind, within run spread. Short batches with few rows per SM lose (fp16
  M=4096: N=1024 1574 against 1733, N=3072 2549 / 2679): fewer, fuller blocks leave SMs idle.
  Fewer vectors per thread lost before the launch bounds too (N=2048 3723 at 4 vectors against
  3546 at 2, 2802 at 1). Every variant stays under ptxas' limit with no spills
  (tests/test_compile.py);
* the forward's 16-bit and double rows in blocks of up to FWD_CENTER_BLOCK threads keep their values
  centered in the arithmetic type instead (FWD_CENTER_BYTES a thread: 4 vectors of 16-bit values as
  float copies, layer_norm_fwd.cu CENTER), where every thread's slots hold packs, at
  FWD_CENTER_THREADS threads per SM (80 registers: the copies and w and b in flight; on sm_90
  FWD_REG_THREADS where a launch then fits one wave: forward_launch_plan). The 16-bit rows are
  issue-bound and the copies cut each pass to one instruction an element (H200, M*N = 2**27, against
  8 vectors as loaded: bf16 N=512 3977 GB/s against 3895, 1000 3949 / 3844, 1024 4022 / 3941, 2048
  4080 / 3936, 4096 4035 / 3922, fp16 N=1024 4026 / 3943, float64 N=1024 4104 / 3692). At 1024
  threads (64 registers) the copies were 0.4-2% slower. Rows whose last slot is empty (bf16 N=768)
  lost at 768 threads (3755 against 3972 as loaded) and spill at 1024 for sm_80, so they stay as
  loaded, as do wider blocks (bf16 N=8192 in 256 threads 3848 at 768, 3980 at 1024, 3937 as loaded;
  12288 3683 / 3941 in 384 threads) and float32 rows, which convert nothing (-1% to +0.6%). Double
  rows, centered in the registers they were loaded into, take it in every block (float64 N=3072 4115
  GB/s against 2541, 4096 4114 / 3077, 6144 3352 / 2370, 8192 3653 / 2744). On sm_90, 16-bit rows of
  a warp or less whose packs fill 3 of a thread's 4 slots (N=192, 384, 768; 16-bit w and b) keep
  centered copies in just those 3, at FWD_REG_THREADS an SM (FWD_CENTER_EXACT; H200, one process,
  best of 5, bf16 (fp16) GB/s). Long launches, against 8 vectors as loaded: 174762 x 768 3991 / 3965
  and 4007 / 3962 in two runs (4003 / 3961, 3993 / 3958), 349525 x 384 3962 / 3920 (3962 / 3921),
  699050 x 192 3942 / 3924 (3943 / 3920); at 768 threads an SM they lost (768: 3900). Short
  launches, at 768 threads against 4 vectors as loaded: 1024 x 768 599 / 534 (599 / 531); 4096 x 768
  1645 / 1507 (1652 / 1495); 16384 x 768 2712 / 2632; 65536 x 768 3620 / 3557 (3593 / 3564); 8192 x
  384 1684 / 1521; 131072 x 384 3600 / 3524; 65536 x 192 2728 / 2598 (+0% to +13%, never behind);
  1024 threads then took 0-2.5% more (131072 x 768 3929 / 3837, 65536 x 768 3691 / 3641, 16384 x 768
  2743 / 2724);
* at least 4 threads per row: small rows still get several independent 16-byte loads per
  warp row instead of one thread walking a row;
* 128 threads per block for the sub-warp tier (1.5% behind 256 at N=512/1024, within noise);
  wider rows get a block sized to the row in steps of 64 threads (the backward's 16-bit rows
  of one block under BWD_REG_AHEAD_BLOCK threads in steps of a warp: _bwd_small_block, and
  rows of 64 threads of 3 packs of 4, in short launches also rows of 64 or 128 threads of 2
  packs of 8, several a block: _bwd_group_block), up to
  512 for the backward and double rows (1024-thread blocks cap a thread at 64 registers and
  ptxas spills them) and
  up to 1024 for the forward of 16- and 32-bit rows, which the rows kept as loaded fit. On
  sm_90, forward rows in 16-byte vectors past 512 threads split over a thread-block cluster
  instead (FWD_REG_CLUSTER_*);
* the forward's launch bounds ask ptxas for FWD_REG_THREADS threads per SM (64 registers a
  thread), so registers do not hold occupancy down: bf16 N=32768 3216 GB/s at 2 blocks of 512
  per SM against 2807 at one (71 registers), float32 N=16384 3842 against 3599; bf16 N=65536
  at 1024 threads 2406 against 2083 for the ring tier. 1536 threads (40 registers, 16-bit rows
  of 4 vectors) measured 0.5-2% slower at N=512-2048;
* 16-bit rows in 16-byte vectors, with 16-bit w and b, of FWD_LEAN_FROM elements and up keep
  FWD_REG_ITEMS_SHORT vectors a thread where that block splits FWD_LEAN_THREADS evenly (192,
  256, 384 or 512 threads: N=6144-8192, 10241-12288, 14337-16384), and such rows of 4 vectors
  in a block of their own (short launches too) ask for FWD_LEAN_THREADS threads per SM (40
  registers): half the bytes in flight a thread, half again the warps. H200, M*N = 2**27, one
  process, best of 3, GB/s against 8 vectors at 1024 threads: bf16 N=6144 4043 / 3981, 8192
  3981 / 3935, 11264 4011 / 3963, 12288 3961 / 3929, 15360 3958 / 3936, 16384 3996 / 3927, fp16
  6144 4025 / 3983, 16384 3995 / 3934; short launches, 4 vectors at 1536 threads against 1024
  (fp16 M=4096): N=5120 3128 / 3027, 8192 3469 / 3355, 10240 3553 / 3336, 14336 3605 / 3172,
  15872 3733 / 3393, bf16 M=2048 N=16384 3295 / 3131 (M=1151 N=8192: 2201 / 2289). Blocks of
  320 and 448 threads lost at 4 vectors (N=9216 3948 / 4013, 13312 3866 / 3950; grown to 384
  and 512, 3920 and 3844), narrower rows lost or tied (N=2560 3866 / 4054, 4608 3962 / 4067,
  5120 4011 / 4019), 2048 threads spill at 32 registers (N=16384 3230). Only on sm_90 (devices
  with clusters): at 40 registers float32 w or b spill, and sm_80's ptxas spills 8 bytes in
  blocks of 192, 384 and 448 threads;
* in long launches of at most MAX_GRID rows on sm_90 devices with fast DRAM
  (FWD_STREAM_DRAM_PER_SM), 16-bit rows in 16-byte vectors with 16-bit w and b stream instead
  (layer_norm_fwd.cu ln_fwd_stream): the threads of a row sum it from HBM and read it again from L1
  or L2 for y, 32 registers a thread at FWD_STREAM_THREADS an SM. Rows of up to 2 * FWD_STREAM_PAIRS
  packs take two packs a thread in the fewest warps where they fill them (N = 512, a warp a row,
  eight rows a block; 1024, 1536, ..., 4096: 64-256 threads, a block a row), and N = 896-1016 in 64
  threads, the last packs of some threads past the row (partial); wider rows whose packs split
  evenly over 256-640 threads (a multiple of 32) at 3 or 4 packs, or 256-384 at 2 (FWD_STREAM_EVEN;
  N = 6144: 256 threads of 3 packs; 12288, 16384: 512 of 3-4; 5120, 7680, 10240: 320 of 2-4; 14336:
  448 of 4; 20480: 640 of 4; and 17 more widths up to 20480), or over one of FWD_STREAM_SHAPES first
  (8192: 512 of 2), a block a row. H200, M*N = 2**27, one process, best of 5, three x rotated
  between calls, GB/s against the register rows: bf16 N=4096 4151 / 4007, 6144 4069 / 4023, 8192
  4042 / 3938, 12288 4109 / 3958, 16384 4012 / 3965; fp16 4140 / 3990, 4066 / 4018, 4061 / 3946,
  4111 / 3974, 3944 / 3955; copy 4254, bf16 (fp16): N=5120 4122 / 4014 (4088 / 4019), 7680 4117 /
  4005 (4119 / 4008), 10240 4034 / 3980 (4032 / 3978), 14336 4065 / 3950 (4062 / 3956), 20480 4057 /
  3906 (4061 / 3923); 7168 over 448 threads of 2 lost, 3976 / 4021. Narrow rows (copy 4226-4255),
  bf16 (fp16): N=512 3994 / 3962 (3981 / 3974), 1024 4071 / 4006 (4076 / 4017), 1536 4099 / 3953
  (4055 / 3957), 2048 4126 / 4073 (4121 / 4071), 2560 4148 / 4037, 3072 4146 / 3991 (4099 / 3995),
  3584 4175 / 3825; partial: 896 3839 / 3779 (3880 / 3800), 1000 3976 / 3929 (3977 / 3923). Partial
  rows of more threads lost but where the register rows are weak (1400 3865 / 3920, 2240 3798 /
  3924, 2400 3823 / 3971, 3000 3846 / 3929, 4000 3858 / 3918; 1792 3967 / 3874, 3136 3746 / 3562),
  as did rows of 64 threads filling 3/4 (768 3643 / 3973, 1152 3680 / 3960) and a warp's partial
  rows (480 3662 / 3886). Other shapes of narrow rows lost: one pack a thread (N=1024 over 128
  threads 3735 / 3983), a warp of 3-4 packs (768 3797 / 3972, 1024 3722 / 4008), three packs where
  two fit (1536 over 64 threads 4020, 3072 over 128 4041-4052); blocks of 64 threads for rows of a
  warp (N=512 3978 / 3962); blocks of 256 threads (eight rows) ahead of 128 by 0.3-0.5% (bf16 4008 /
  3997, 4010 / 3991; fp16 4015 / 4001, 4011 / 3992 in two rounds). More packs a thread lost (bf16
  N=8192 over 256 threads 3784 against 3964, 10240 3681, 14336 3436, 16384 3251; 20480 over 512:
  3844 / 3907; 24576 3681), as did blocks of 1024 (N=16384 3554 / 3955; 32768 level, 3876 / 3870), x
  loaded past L1 in pass 1 too (N=8192 3791, 12288 3819) and, in a first form, a grid-stride row
  loop (N=4096 2096). On an H100 SXM (3.35 TB/s), whose register rows reach 97% of its copy
  bandwidth, that first form lost 1-5% (bf16 N=4096 2869 / 2929, 16384 2778 / 2922; level at 8192,
  2944 / 2932): hence the DRAM gate. FWD_STREAM_EVEN's widths, one process, best of 3, bf16 (fp16)
  GB/s against the register rows, M*N = 2**27: N=4608 (288 x 2) 4178 / 4036 (4122 / 4053), 5632 (352
  x 2) 4029 / 3990 (3976 / 3986), 6912 (288 x 3) 4103 / 4016, 9216 (384 x 3) 4127 / 4001 (4130 /
  3997), 11264 (352 x 4) 4045 / 4008 (4033 / 4018), 13824 (576 x 3) 4140 / 3956, 14592 (608 x 3)
  4139 / 3936 (4133 / 3933), 19456 (608 x 4) 4065 / 3926 (4070 / 3926): +0.4% to +5.2% at all 17 but
  fp16 5632 (-0.3%); M=4096: +0.7% to +9.4% (8448: 3620 / 3309). Two packs over 416 threads or more
  lost (N=6656 over 416 3887 / 3985, 8704 over 544 3749 / 3993, 9216 over 576 3768 / 3982, 9728 over
  608 3813 / 3960; 7168 over 448 above), as 288 x 4 did to 384 x 3 at 9216 (3997) and 480 x 4 to 640
  x 3 at 15360 (4048 / 4116); so did partial rows over 256-640 threads at 3-4 packs, at every one of
  19 other widths, long and short, -1.3% to -14.8% (bf16 N=15872 as 512 x 4, 97% of the slots
  filled, 3682 / 3971; 12000 as 512 x 3 3658 / 3983; 6000 as 256 x 3 3832 / 3964). Short launches
  stream too where none of forward_launch_plan's register plans fits one wave of resident blocks
  (FWD_STREAM_SHORT: +0.6% to +28% in every such launch measured, bf16 M=512 N=16384 2533 GB/s
  against 1975, 1024 x 8192 2300 / 2030, 4096 x 3584 2991 / 2797, 16384 x 1024 3086 / 2996; in one
  wave it lost, 4096 x 1024 1771 / 1876);
* the backward's 16-bit rows of at least BWD_REG_AHEAD_BLOCK threads copy the next row's x and
  dy into shared memory with cp.async while a row is computed (layer_norm_bwd.cu, AHEAD): bf16
  N=8192 3169 GB/s against 2805, N=4096 3501 / 3396, fp16 M=4096 N=8192 2615 / 2395. Smaller
  blocks lost (bf16 N=1024 3142 against 3432), and so did float32 (N=4096 3691 against 4074);
* such rows in blocks of at least BWD_SHARED_SUMS_BLOCK threads keep the dw/db sums in shared
  memory instead of registers (layer_norm_bwd.cu, SHARED_SUMS): a thread then needs 64
  registers, so two blocks of 512 threads share an SM where one did, and rows of up to 16K
  elements stay in registers in blocks of up to BWD_SHARED_SUMS_BLOCK_MAX threads, where the
  ring tier took them (H200, against the sums in registers, one process, best of 3: bf16
  N=8192 3418 GB/s against 3104, 10240 3085 / 2326 (ring), 12288 3038 / 3027 (ring), 16384
  3075 / 3044 (ring)). Blocks that already share an SM two at a time lost (N=5120 3031 against
  3209 with three blocks of 320 threads, 6144 3298 / 3467); rows that would need a block of
  more than BWD_LONE_FROM threads run 512 threads of 4 vectors (bf16 N=16384 3417 GB/s
  against 3173 in 1024 threads of 2);
* the 16-bit register rows with w of x's dtype copy their columns of w into shared memory once
  and read it there (layer_norm_bwd.cu, STAGE_W): blocks of several rows one copy for all of
  them, blocks that copy the next row ahead where the SM still holds as many of them (not on
  sm_80 beside the sums of 768 threads); in a cluster whose sums stay in registers only for
  bf16 (fp16 blocks of 384 threads then spill 56-60 bytes: N=24576 2542 GB/s against 2998,
  49152 2586 / 3022), and not for w of the other 16-bit dtype (fp16 x with bf16 w spilled
  8-28 bytes, unmeasured). Against w read through L1: bf16 N=4096-65536 +3.5% to +7.9%
  (layer_norm_bwd.cu), N=384-3072 +2.0% to +3.3% (one process, best of 3: 384 3774 / 3657, 512
  3982 / 3856, 768 3719 / 3612, 1000 3744 / 3646, 1024 3836 / 3748, 1536 3779 / 3659, 2048
  3758 / 3678, 3072 3679 / 3576; fp16 768 3802 / 3736, 1024 3903 / 3860, 2048 3855 / 3810;
  short launches fp16 M=4096 N=1024 1485 / 1462, bf16 M=4096 N=2048 1935 / 1866), the clusters
  of sums in registers bf16 N=18432 3066 / 3039, 20480 3240 / 3174, 24576 3171 / 2944, 40960
  3134 / 3031, 49152 3203 / 2926;
* such rows in a block of their own that shares its SM take the block size that splits the
  launch bounds' threads per SM evenly (BWD_REG_THREADS, BWD_SHARED_SUMS_THREADS): 384
  threads where 320 would leave 128 of 768 unused, 512 for 448 (_bwd_fill_sm: bf16 N=5120
  3625 GB/s against 3238, 7168 3492 / 3284);
* on sm_90, such backward rows past one block split over the fewest blocks (2, 4 or 8) of at
  most BWD_REG_CLUSTER_BLOCK threads of 4 vectors (up to 65536 elements): a thread-block
  cluster, the blocks adding their row sums through distributed shared memory, each block
  holding two rows so that a row's wait for the cluster's sums overlaps the next row's first
  pass (ln_bwd_reg_cluster; bf16 N=32768 3086 -> 3603 GB/s, 65536 3126 -> 3586 against the
  clusters that waited for each row; 2302 / 2165 for the staged cluster tier before those);
* the backward and the forward's staging tiers run a persistent grid of exactly the resident
  blocks: for the backward 0.5x and 2x that were measured 5-30% slower (fewer blocks leave SMs
  idle; more add dw/db partial rows). The forward's register tier launches a block per group
  of rows instead (forward_grid: bf16 N=512-32768 2-16% faster, fp16 M=4096 N=15872 3174 ->
  3641 GB/s; float32 N=32768 at 1024 threads 3551 -> 3418, within run-to-run spread), except
  its clusters, which stay persistent (bf16 N=65536 3269 GB/s against 2887 a cluster a row);
* forward rows past the register tier that fit the shared memory take the ring tier (RING_*
  below): the jagged forward's staging rings, loads of the next rows overlapping a row's
  arithmetic;
* the backward's persistent grid stops at M / (rows per block * BWD_MIN_STEPS) blocks: each
  block writes a dw/db partial row, which short batches would otherwise pay for (fp16
  M=4096, N=1024: 1041 GB/s against 972); but a grid that leaves SMs with few threads grows
  (BWD_FILL, backward_grid);
* other backward rows past the register tier up to 16K elements take its ring tier
  (BWD_RING_BLOCK): x and dy staged ahead with cp.async, the dw/db accumulators in registers;
* on sm_90, wider rows split their columns over a thread-block cluster of such blocks (the
  "cluster" tiers: backward rows past one SM's registers, forward rows past one ring), the
  blocks exchanging row statistics through distributed shared memory;
* other rows past the register tier go to one block per row, staged in shared memory when
  N * itemsize (x 2 for backward) fits the device's opt-in limit, re-read otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import _compile
from ._dtypes import acc_dtype, ctype

FWD_REG_ITEMS = 8  # forward: vectors of the row a thread keeps (128 bytes in 16-byte vectors)
FWD_REG_ITEMS_SHORT = 4  # ...in launches of fewer than FWD_SHORT_WAVES waves at FWD_REG_ITEMS
FWD_SHORT_WAVES = 12  # waves of FWD_REG_THREADS threads on every SM (forward_items)
FWD_CENTER_BYTES = 128  # forward rows kept centered in the arithmetic type: bytes a thread
FWD_CENTER_BLOCK = 128  # ...in blocks of at most this many threads (copies; double: any)
FWD_CENTER_THREADS = 768  # ...and their launch bounds' threads per SM
FWD_CENTER_EXACT = True  # ...16-bit rows of a warp or less in the slots they fill (sm_90)
FWD_REG_THREADS = 1024  # forward launch bounds: threads per SM (16- and 32-bit rows)
FWD_LEAN_FROM = 6144  # 16-bit rows this wide keep FWD_REG_ITEMS_SHORT vectors in any launch...
FWD_LEAN_THREADS = 1536  # ...where the block divides this; such rows' launch bounds (threads/SM)
BWD_REG_AHEAD_BLOCK = 256  # 16-bit backward blocks this large copy the next row's x and dy ahead
# Threads per SM the backward register tier's launch bounds ask for 16-bit rows, with the dw/db
# sums in registers and in shared memory (kernels/layer_norm_bwd.cu, BwdRegBlocks)
BWD_REG_THREADS = 768
# 16-bit backward rows of a few threads' worth (at most BWD_GROUP_VALUES elements of x a thread,
# a number of threads that divides BWD_GROUP_BLOCK: N = 520-768, 64 threads of 3 packs of 4)
# share blocks of BWD_GROUP_BLOCK threads, a row group each with its own named barrier, at 1024
# threads an SM (BwdRegBlocks: 64 registers, which their lone blocks reached anyway): a block
# writes one dw/db partial row for all its row groups, so the partial reduce reads 4 times fewer
# bytes (_bwd_group_block has the measurements). In short launches (backward_short) rows of
# up to BWD_GROUP_SHORT_VALUES (2 packs of 8: N = 776-1024 in 64 threads, 1544-2048 in 128)
# share blocks too, at the 768 threads an SM of their lone blocks.
BWD_GROUP_BLOCK = 256
BWD_GROUP_VALUES = 12
BWD_GROUP_SHORT_VALUES = 16
BWD_SHARED_SUMS_THREADS = 1024
BWD_REG_VALUES = 16
BWD_SHARED_SUMS_BLOCK = 448  # 16-bit backward blocks this large keep dw/db in shared memory
BWD_SHARED_SUMS_BLOCK_MAX = 1024  # ...in blocks of up to this many threads
# ...but rows whose block would pass BWD_LONE_FROM threads (one block an SM) run
# BWD_LONE_BLOCK threads of BWD_LONE_ITEMS vectors instead, where they hold the row and its
# sums fit (H200, M*N = 2**27, one process, best of 3, bf16 / fp16 GB/s against 2 vectors a
# thread: N=12288 3382 / 3350 against 3233 / 3250 (768 threads), 13312 3376 / 3331 against
# 3026 / 3050 (832), 14336 3394 / 3352 against 3173 / 3197 (896), 15360 3389 / 3404 against
# 3169 / 3230 (1024), 16384 3417 / 3353 against 3173 / 3246 (1024; a second run 3414 / 3447
# against 3187 / 3286; at 64 registers, blocks of 960 threads spilled; 10752 and 11264 3343 /
# 3301 and 3341 / 3302 against 3010 / 3013 and 2981 / 2976 in 704 threads). Not at 10240 (3285
# / 3267 against 3378 / 3371 in 640 threads; a second run 3290 / 3239 against 3353 / 3341),
# nor in fewer threads that fit the row (12288 in 384: 3210 / 3217, 448: 2980 / 2890; 14336
# in 448: 2986 / 2929)
BWD_LONE_FROM = 640
BWD_LONE_BLOCK = 512
BWD_LONE_ITEMS = 4
# Backward 16-bit rows in 16-byte packs past one register block (N > 16384) split over a
# thread-block cluster (sm_90, ln_bwd_reg_cluster) of the fewest blocks of at most
# BWD_REG_CLUSTER_BLOCK threads (at least BWD_REG_CLUSTER_LEAST) of BWD_REG_CLUSTER_ITEMS vectors
# a thread, up to BWD_REG_CLUSTER_MAX blocks (_bwd_reg_cluster has the measurements).
BWD_REG_CLUSTER_BLOCK = 256
BWD_REG_CLUSTER_LEAST = 128
BWD_REG_CLUSTER_ITEMS = 4
BWD_REG_CLUSTER_MAX = 8
BWD_REG_CLUSTER_THREADS = 512  # threads an SM its launch bounds ask for (LagBlocks)
BWD_MIN_STEPS = 8  # groups of rows each backward block walks at least (backward_grid)...
# ...unless its SM would have fewer threads than these: (threads an SM, least steps a block)
BWD_FILL = ((512, 3), (256, 1))
MAX_ITEMS = 8  # vector slots per thread: 16 unrolled scalar slots spill in the backward
MIN_TPR = 4
SUBWARP_BLOCK = 128
REG_BLOCK_STEP = 64  # block-per-row sizes: multiples of 64 threads...
REG_BLOCK_MAX = 512  # ...up to 512 (1024 threads cap a thread at 64 registers: ptxas spills)
FWD_REG_BLOCK_MAX = 1024  # ...up to 1024 for the forward of 16- and 32-bit rows
# Forward 16/32-bit rows in 16-byte vectors whose register block would have more than
# FWD_REG_CLUSTER_BLOCK threads split over a thread-block cluster of such blocks (sm_90,
# ln_fwd_reg_cluster), up to FWD_REG_CLUSTER_MAX blocks: several blocks share an SM where one
# would hold the whole row (H200, M*N = 2**27: bf16 N=65536 2858 GB/s against 2427 for one
# 1024-thread block, bf16 x with float32 w/b 2844 / 2614; fp16 2977 / 3187, float32 N=32768
# 3457 / 3470; again with cd1ea10's kernels, bf16 3393 / 3198, fp16 3398 / 3157, bf16
# N=49152 3547 / 3167, 40960 3494 / 3131: docs/benchmark-log.md), and rows past one block's
# registers leave the staging tiers (bf16 N=131072 2600 against 1723, 262144 2334 / 1673; float32
# N=40000 3116 / 2801, 65536 3080 / 2683).
FWD_REG_CLUSTER_BLOCK = 512
FWD_REG_CLUSTER_MAX = 8
# A register cluster's blocks copy their slices of w and b into shared memory once and read
# them there for every row (STAGE_WB) where the SM's blocks' copies take at most
# FWD_STAGE_WB_SM bytes: read through L1, they come from L2 on most rows (Nsight Compute, bf16
# N=65536: L1 hit 8-11% of the sectors, though an SM's two blocks hold one slice: the clusters'
# wait empties L1 each row, kernels/cluster.cuh). The rest of the SM's 256 KB of L1 and shared
# memory holds the loads in flight: at 224 KB of copies the forward lost (bf16 N=57344 2887
# GB/s against 3313). H200, M*N = 2**27, one process, best of 3, GB/s staged against read
# through L1: bf16 N=45056 3481 / 3107, 49152 3545 / 3178, 98304 3057 / 2913; float32 N=24576
# 3844 / 3512, 49152 3729 / 3299. Where copies at the plan's blocks per SM would not fit, the
# 16-bit rows read w and b through L1 as before (bf16 N=65536 3381 against 2913 staged at one
# block an SM, 36864 3345 / 3295 at 2 blocks instead of 3, and 2989-3044 over twice the blocks
# of half the threads: issue-bound, they lose on fewer warps). float32 rows, whose passes take
# half the instructions a byte, stage at fewer blocks per SM, two or more (N=18432 3852 / 3654
# at 2 blocks instead of 3, 20480 3831 / 3708), else over twice the blocks of half the threads
# (N=28672 3745 / 3569, 32768 3709 / 3655; at 65536, over 8 blocks, 3026 / 3516). Those widths
# now hold two rows a block (FWD_LAG_BLOCK), which leaves the split to devices with less shared
# memory a block.
FWD_STAGE_WB_SM = 200 * 1024
# float32 register clusters of blocks of FWD_LAG_BLOCK threads or more hold two rows a block, one
# block an SM (ln_fwd_reg_cluster's LAG), where one block's copies of w and b fit: the next row's
# loads go out before a row waits for the cluster's statistics and writes y. H200, M*N = 2**27, one
# process, best of 3, GB/s against the plans before (their shapes, 2 or 3 blocks an SM): N=28672 (2
# x 448) 3868 / 3748, 32768 (2 x 512) 3881 / 3705, 65536 (4 x 512) 3855 / 3522, 131072 (8 x 512)
# 3834 / 3256; blocks of 384 threads within what runs differ by (24576, 2 x 384: 3839 / 3857; 49152,
# 4 x 384: 3777 / 3708, and 3724 / 3770 in a second run; 98304, 8 x 384: 3697 / 3628, 3698 / 3622 in
# a third); smaller blocks, alone on their SMs, lost: 18432 (2 x 288) 3541 / 3841, 20480 (2 x 320)
# 3683 / 3845, 40000 (4 x 320) 3489 / 3723, and blocks of half the threads at two an SM did not gain
# (32768, 4 x 256: 3794). 16-bit rows lost at every width: 8 vectors a row, one block of 512 an SM,
# bf16 N=65536 3371 / 3373, fp16 3323 / 3402; 4 vectors at two blocks of 512, 2544 / 3383
# (issue-bound, on fewer warps).
FWD_LAG_BLOCK = 384
# The forward's stream tier (module notes): rows of up to 2 * FWD_STREAM_PAIRS packs take two a
# thread, in the fewest warps that hold them, where they fill those warps' packs (rows of a
# warp: eight a block of FWD_STREAM_WARP_BLOCK threads) or, in FWD_STREAM_PARTIAL threads, at
# least FWD_STREAM_FILL of them (the last packs of some threads past the row); wider rows take
# the first of FWD_STREAM_SHAPES, (threads a row, packs a thread), that splits them evenly, then
# the first of FWD_STREAM_EVEN, (packs a thread, most threads), whose threads, a multiple of 32
# and at least FWD_STREAM_EVEN_LEAST, split them evenly: a block a row. FWD_STREAM_SHAPES holds
# the one shape measured ahead of FWD_STREAM_EVEN's (N = 8192 over 512 threads of 2: 4042 GB/s,
# where 256 of 4 read 3784). The launch bounds ask for FWD_STREAM_THREADS an SM (at most:
# blocks of 320, 448 and 640 threads fit 1920, 1792 and 1920).
FWD_STREAM_PAIRS = 256
FWD_STREAM_PARTIAL = 64
FWD_STREAM_FILL = 0.875
FWD_STREAM_SHAPES = ((512, (2,)),)
FWD_STREAM_EVEN = ((3, 640), (4, 640), (2, 384))
FWD_STREAM_EVEN_LEAST = 256
FWD_STREAM_THREADS = 2048
FWD_STREAM_WARP_BLOCK = 256  # threads a block where a row takes a warp (8 rows a block)
# Rows of two packs a thread over more than a warp and at most FWD_STREAM_ROLL_THREADS threads,
# all filled, run pass 2 as a loop (ln_fwd_stream's ROLL). H200, M*N = 2**27, one process, best
# of 5, bf16 (fp16) GB/s, unrolled / rolled: N=1024 4073 / 4115 (4073 / 4109), 1536 4119 / 4151
# (4071 / 4116), 2048 4131 / 4144 (4125 / 4160); 16384 x 1024 3086 / 3125 (3075 / 3091); a second
# run +0.4% to +1.5%, 16384 x 1024 and 8192 x 2048 +0.5% to +0.9%. It lost past them: 2560 (160
# threads) 4150 / 4101 (4111 / 4088), 3072-8192 -1.4% to -3.9%, 20480 (640 x 4) -2.2% to -2.5%,
# 1000 (partial) 4007 / 3834; 12288 and bf16 16384 level, fp16 16384 +1.4%.
FWD_STREAM_ROLL_THREADS = 128
# Rows where x, w or b is of one of these dtypes read w and b in pass 2 through coherent loads
# (ln_fwd_stream's COHERENT_WB). H200, M*N = 2**27, one process, best of 5, GB/s read-only /
# coherent (x / w and b): fp16 / fp16 N=16384 3967 / 4037 (no spill then), 3072 4098 / 4159, 5120
# 4079 / 4111, 8192 4069 / 4054, the rest -0.2% to +0.4%; fp16 / bf16 16384 3953 / 4021, 5120
# 4099 / 4151; bf16 / fp16 16384 3951 / 4027, 5120 4089 / 4139, 4096 and 8192 0.0-0.3%; short
# launches (2**24) fp16 3276 x 5120 3008 / 3061, 1024 x 16384 2891 / 2945, 4096 x 4096 -0.5%.
# bf16 / bf16 lost at 8192 (4048 / 4009) and in short launches of 4096 and 8192 (-1.2% to -1.5%),
# and gained 0.4% at 16384: it keeps the read-only path. A first run agreed within 0.5 points.
FWD_STREAM_COHERENT_WB = frozenset({"float16"})
# ...taken on devices whose peak DRAM bandwidth an SM is at least this (bytes/s): on an H200 (4.8
# TB/s, 132 SMs: 37 GB/s an SM) it gained; on an H100 SXM (3.35 TB/s: 25 GB/s an SM), whose
# register rows reach 97% of its copy bandwidth, its first form lost (module notes)
FWD_STREAM_DRAM_PER_SM = 30e9
FWD_STREAM_SHORT = True  # ...and short launches stream where no register plan fits one wave
# Row tiers: 256 threads measured faster than 512 where two or more blocks share an SM and
# overlap their phases (forward N=8192 1689 against 983 GB/s, backward N=12288 1478 against
# 1039); where the staged row leaves room for one block per SM, the forward needs the 512
# threads (N=65536 bf16: 1553 GB/s at 512 against 975 at 256).
ROW_BLOCK = 256
ROW_BLOCK_ALONE = 512
STATIC_SMEM_MARGIN = 1024  # the kernels' own static shared memory (reductions), bytes
# Ring tier (kernels/jagged.cu ln_fwd_ring): forward rows past the register tier that fit a
# staging ring go through the jagged forward's ring kernel, whose rings load the next rows with
# cp.async while a row is reduced and written. RING_SPLIT blocks of RING_BLOCK_SPLIT threads
# share an SM when a row fits their share, else two or one block of RING_BLOCK. Since the
# register tier holds 16/32-bit rows of up to 1024 x 8 vectors, these are mostly float64 rows
# and rows that allow only narrower vectors (bf16 N=65536: 2406 GB/s in registers against 2083).
# scripts/tune_ring.py (docs/tune_ring_h200.txt), H200, M*N = 2**27, GB/s against the row tier:
# fp32 N=24576 3669 (2 x 512) vs 2313; bf16 N=32768 2772 vs 1733, 65536 2419 (1 x 512) vs 1660.
# Each ring holds one row (shared memory sized to it): the blocks that then fit an SM overlap
# each other's loads, and the memory a ring leaves is L1 for w and b (bf16 N=12288 2848 GB/s
# against 2696 with rings filling their share, N=16384 2844 / 2807, fp32 N=8192 3594 / 3452).
RING_SPLIT = 3
RING_BLOCK_SPLIT = 256
RING_BLOCK = 512
# Forward cluster tier (layer_norm_fwd.cu ln_fwd_cluster, sm_90): rows too wide for one block's
# ring are split over a thread-block cluster of the fewest blocks whose rings hold
# FWD_CLUSTER_ROWS rows of slices, FWD_CLUSTER_SPLIT blocks of FWD_CLUSTER_BLOCK_SPLIT threads
# per SM (scripts/tune_cluster.py --forward, H200: fp32 N=65536 2867 GB/s at 3 x 256 threads
# and 4 blocks per cluster, against 2733 at 2 x 256, 2226 at 1 x 512 and 1946 for the row
# tier). Where one ring holds the row, the ring tier stays ahead: fp32 N=32768 3303 against
# 3038, bf16 N=65536 2094 against 1905.
FWD_CLUSTER_BLOCK = 512  # with FWD_CLUSTER_SPLIT = 1
FWD_CLUSTER_BLOCK_SPLIT = 256
FWD_CLUSTER_SPLIT = 3
FWD_CLUSTER_ROWS = 1
# Backward ring tier (layer_norm_bwd.cu ln_bwd_ring): rows past the register tier whose x and
# dy fit the shared memory, with the dw/db accumulators (2 * items * vec values of A per thread,
# at most twice the register tier's budget) in registers: one block of BWD_RING_BLOCK threads
# per SM, its whole shared memory a staging ring. Wider rows (sm_90+) split each row's columns
# over a thread-block cluster of 2, 4 or 8 such blocks (ln_bwd_cluster, tier "cluster"): the
# smallest cluster whose blocks' slices fit their registers and rings (scripts/tune_cluster.py,
# H200, M*N = 2**27: the smallest beat every larger one measured, e.g. bf16 N=32768 2102 GB/s
# at 2 against 1745 at 4 and 1304 at 8, against 1245 for the row tier). Where a ring holds two
# rows of slices, the next row's pass 1 overlaps the cluster's exchange (lag 1): bf16 N=65536
# 1961 against 1884, fp32 N=65536 (8 blocks) 2708 against 2441.
BWD_RING_BLOCK = 512
MAX_CLUSTER = 8  # the portable cluster size limit
MAX_GRID = 2**31 - 1  # blocks in a grid's x dimension; the kernels' row loops take the rest
REDUCE_BLOCK = (32, 8)  # ln_bwd_dwdb_cols
# ln_partial_reduce: blocks of (32, Y) threads, Y = 32, or PARTIAL_REDUCE_FEW_Y where fewer
# than PARTIAL_REDUCE_FEW partial rows leave each of 32 row phases little to add
# (partial_reduce_shape)
PARTIAL_REDUCE_Y = 32
PARTIAL_REDUCE_FEW = 256
PARTIAL_REDUCE_FEW_Y = 8
# ln_partial_reduce launches on sm_90 with programmatic stream serialization (_driver.py): its
# blocks start as the partials' kernel's blocks leave and wait for that grid's writes (H200, one
# process, two runs, GB/s against a plain launch: fp16 M=4096 N=1024 1181 -> 1224 and 1170 ->
# 1225, N=4096 2344 -> 2397 / 2364 -> 2407, N=8192 2797 -> 2863 / 2811 -> 2870, M=1151 N=8192
# 1382 -> 1432 / 1383 -> 1426, float32 M=4096 N=769 1546 -> 1589 / 1531 -> 1580; the bf16
# sweep at M*N = 2**27 +0.2% to +0.9%; fp16 M=32768 N=1000 -0.1% / -0.2%)
REDUCE_AFTER_PRIOR = True


@dataclass(frozen=True)
class Plan:
    """One kernel launch shape. ``rows`` rows per block; ``smem`` dynamic shared bytes."""

    source: str
    expr: str
    tier: str  # "reg", "stream", "ring", "cluster" or "row"
    vec: int
    items: int
    tpr: int
    block: int
    rows: int
    smem: int
    cluster: int = 1  # blocks per thread-block cluster, each with a slice of the row
    threads: int = 0  # the forward register tier's launch bounds: threads per SM (0: none)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _staged(elements: int, itemsize: int) -> int:
    """Shared bytes staging ``elements`` elements of ``itemsize`` (a 16-byte multiple)."""
    return _cdiv(elements * itemsize, 16) * 16


def _slice_packs(n: int, vec: int, cluster: int) -> int:
    """Packs of VEC elements in the widest of ``cluster`` blocks' column slices of a row."""
    return _cdiv(_cdiv(n, vec), cluster)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def vector_width(itemsize: int, n: int, strides=(), pointers=()) -> int:
    """Largest VEC (elements, VEC * itemsize <= 16 bytes) dividing N and every row stride, with
    every pointer aligned to VEC * itemsize bytes. 1 is the scalar path."""
    vec = 16 // itemsize
    while vec > 1:
        if (
            n % vec == 0
            and all(s % vec == 0 for s in strides)
            and all(p % (vec * itemsize) == 0 for p in pointers)
        ):
            return vec
        vec //= 2
    return 1


def _reg_shape(n: int, vec: int, values: int, block_max: int, step: int = REG_BLOCK_STEP):
    """(tpr, items, block) for the register tier, or None when the row does not fit.
    Rows of up to 32 threads' worth: the fewest threads (a power of two, at least MIN_TPR) that
    hold the row at the full register budget, ITEMS rounded up to a power of two (unused slots
    are predicated off). Wider rows: the full budget per thread and the block sized to the row
    in steps of ``step`` threads."""
    nvec = _cdiv(n, vec)
    items_max = max(1, min(MAX_ITEMS, values // vec))
    if nvec <= 32 * items_max:
        tpr = min(32, max(MIN_TPR, _pow2_at_least(_cdiv(nvec, items_max))))
        return tpr, _pow2_at_least(_cdiv(nvec, tpr)), SUBWARP_BLOCK
    block = _cdiv(_cdiv(nvec, items_max), step) * step
    if block <= block_max:
        return block, items_max, block
    return None


def forward_items(m: int, n: int, vec: int, sm_count: int) -> int:
    """Vectors of its row each forward thread keeps for M rows of N: FWD_REG_ITEMS, or
    FWD_REG_ITEMS_SHORT where the launch would have fewer than FWD_SHORT_WAVES waves of
    FWD_REG_THREADS threads on every SM at FWD_REG_ITEMS, so that short batches spread over
    more threads (fp16 M=4096: N=1024 1524 -> 1753 GB/s, N=4096 2740 -> 2954; M=16384 N=4096
    3654 -> 3794; M=1151 N=1024 544 -> 726; 4 of the 21 short shapes measured lost, by up to 6%:
    fp16 M=4096 N=2048, M=16384 N=512, whose grids at 8 vectors filled one wave: what
    forward_launch_plan now weighs)."""
    threads = m * _cdiv(n, vec * FWD_REG_ITEMS)
    enough = threads >= FWD_SHORT_WAVES * sm_count * FWD_REG_THREADS
    return FWD_REG_ITEMS if enough else FWD_REG_ITEMS_SHORT


def forward_waves(m: int, plan: Plan, sm_count: int) -> float:
    """Waves of resident blocks the grid of a forward register plan (a block per group of rows)
    takes for M rows on ``sm_count`` SMs at its launch bounds' threads per SM; 0 for the other
    plans (their grids are persistent)."""
    if plan.tier != "reg" or plan.cluster > 1 or not plan.threads:
        return 0.0
    return _cdiv(m, plan.rows) / (sm_count * (plan.threads // plan.block))


def forward_launch_plan(m: int, n: int, x_dtype, w_dtype, b_dtype, vec: int, smem_limit: int,
                        max_cluster: int, sm_count: int, dram_per_sm: float = 0.0,
                        affine: tuple = (True, True)) -> Plan:  # fmt: skip
    """The forward's plan for M rows of N: forward_plan at forward_items' vectors a thread; a
    short launch on sm_90 takes instead, of the plans whose grid fits one wave of resident blocks
    (centered rows asking for FWD_REG_THREADS, forward_plan's ``one_wave``; rows of
    FWD_REG_ITEMS vectors), the one that fills it most, where it fills more than that plan's
    waves fill theirs on average (waves / whole waves): no block then waits for a last, partly
    empty wave. H200, one process, best of 5, GB/s, fp16 (bf16): M=4096 N=1024 1672 (1691) at
    768 threads an SM, 1.3 waves, against 1786 (1836) at 1024, one wave; 2048 x 2048 1664 (1722)
    / 1872 (1836); 1024 x 4096 1689 (1719) / 1846 (1824); 8192 x 512 1697 (1730) / 1849 (1910);
    rows kept as loaded at 4 vectors, 1536 threads (1.29 waves) against 8 vectors, 1024 threads
    (0.97): M=4096 N=1280 1788 (1766) / 1992 (1974), 4096 x 1536 1986 (1964) / 2137 (2155),
    2048 x 2560 1743 (1741) / 1838 (1826), 512 x 14336 1863 (1876) / 2198 (2187). A launch that
    fits one wave at 768 threads lost at 1024 (3000 x 1024 1607 / 1555), as did one of two
    waves at either (4400 x 1024 1752 / 1664). ``dram_per_sm``: the device's peak DRAM bytes a
    second an SM; at FWD_STREAM_DRAM_PER_SM or more, long launches of at most MAX_GRID rows
    may stream (forward_plan's ``stream``: a block per row, or per eight rows of a warp), and so
    may short ones where no plan above fits one wave (FWD_STREAM_SHORT). H200, one process,
    best of 5, bf16 (fp16) GB/s, streamed against the short plan: 1024 x 8192 2300 (2305) /
    2030 (2036), 512 x 16384 2533 (2512) / 1975 (1980), 1024 x 12288 2698 (2689) / 2458 (2489),
    4096 x 4096 3125 (3112) / 3007 (2968), 16384 x 1024 3086 (3091) / 2996 (2966), 16384 x 512
    2389 (2413) / 2356 (2367): +0.6% to +28% in every launch of more than one wave measured;
    in one wave the stream lost (4096 x 1024 1771 (1774) / 1876 (1876), 4096 x 512 1344 (1355) /
    1413 (1409), 2048 x 2048 1893 (1879) / 1900 (1910)) or tied (1024 x 4096 1913 / 1893).
    ``affine``: (w given, b given)."""
    items = forward_items(m, n, vec, sm_count)
    stream = dram_per_sm >= FWD_STREAM_DRAM_PER_SM and m <= MAX_GRID
    plan = forward_plan(n, x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster, items,
                        stream=stream, affine=affine)  # fmt: skip
    if items == FWD_REG_ITEMS or max_cluster <= 1:
        return plan
    waves = forward_waves(m, plan, sm_count)
    if not waves:
        return plan
    best, fill = plan, waves / math.ceil(waves)
    for other in (
        forward_plan(n, x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster, items, True),
        forward_plan(n, x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster),
    ):
        w = forward_waves(m, other, sm_count)
        if 0 < w <= 1 and w > fill:
            best, fill = other, w
    if FWD_STREAM_SHORT and stream and best is plan and waves > 1:
        streamed = forward_plan(n, x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster,
                                stream=True, affine=affine)  # fmt: skip
        if streamed.tier == "stream":
            return streamed
    return best


def forward_plan(n: int, x_dtype, w_dtype, b_dtype, vec: int, smem_limit: int,
                 max_cluster: int = 1, items: int = FWD_REG_ITEMS,
                 one_wave: bool = False, stream: bool = False,
                 affine: tuple = (True, True)) -> Plan:  # fmt: skip
    """Kernel variant for the forward of rows of N elements of ``x_dtype``; ``max_cluster``:
    the largest thread-block cluster the device runs (1: none); ``items``: vectors a thread of
    the register tier keeps (forward_items), taken where one block of at most
    FWD_REG_CLUSTER_BLOCK threads holds the row that way (else FWD_REG_ITEMS); 16-bit rows of
    FWD_LEAN_FROM elements and up take FWD_REG_ITEMS_SHORT where its block divides
    FWD_LEAN_THREADS (the module's notes); ``one_wave``: centered rows ask for FWD_REG_THREADS
    per SM (forward_launch_plan; sm_90 only, as the 4-vector rows above); ``stream``: at
    FWD_REG_ITEMS (long launches, and short ones past one wave: forward_launch_plan) and not
    ``one_wave``, 16-bit rows that _fwd_stream gives a shape stream on sm_90 (forward_launch_plan
    asks for it where the device's DRAM is fast enough, FWD_STREAM_DRAM_PER_SM); ``affine``: (w
    given, b given), which the stream tier's kernel takes at compile time."""
    tx, tw, tb = ctype(x_dtype), ctype(w_dtype), ctype(b_dtype)
    row_bytes = _staged(n, x_dtype.itemsize)
    # double x, w or b: 1024-thread blocks and 64 registers a thread spill
    wide = max(x_dtype.itemsize, w_dtype.itemsize, b_dtype.itemsize) > 4
    block_max = REG_BLOCK_MAX if wide else FWD_REG_BLOCK_MAX
    wide16 = vec * x_dtype.itemsize == 16
    # 16-bit rows in 16-byte vectors with 16-bit w and b on sm_90 (the devices with clusters):
    # at 40 registers wider w or b spill, and so do blocks of 192, 384 and 448 threads on sm_80
    sixteen = wide16 and max(x_dtype.itemsize, w_dtype.itemsize, b_dtype.itemsize) == 2
    sixteen = sixteen and max_cluster > 1
    streamed = _fwd_stream(n, vec) if stream and sixteen and items == FWD_REG_ITEMS else None
    if streamed is not None and not one_wave:
        tpr, steps, partial = streamed
        block = tpr if tpr > 32 else FWD_STREAM_WARP_BLOCK
        minb = FWD_STREAM_THREADS // block
        roll = steps == 2 and not partial and 32 < tpr <= FWD_STREAM_ROLL_THREADS
        coherent = bool({x_dtype.name, w_dtype.name, b_dtype.name} & FWD_STREAM_COHERENT_WB)
        args = (tx, tw, tb, vec, tpr, block, steps, minb, partial, roll, coherent, *affine)
        expr = _compile.template("ln_fwd_stream", *args)
        return Plan(
            _compile.FWD_SOURCE, expr, "stream", vec, steps, tpr, block, block // tpr, 0, 1,
            minb * block,
        )  # fmt: skip
    if sixteen and n >= FWD_LEAN_FROM:
        shape4 = _reg_shape(n, vec, FWD_REG_ITEMS_SHORT * vec, block_max)
        if shape4 is not None and FWD_LEAN_THREADS % shape4[2] == 0:  # 192, 256, 384, 512
            items = FWD_REG_ITEMS_SHORT
    shape = _reg_shape(n, vec, items * vec, block_max)
    if items != FWD_REG_ITEMS and (shape is None or shape[2] > FWD_REG_CLUSTER_BLOCK):
        items = FWD_REG_ITEMS
        shape = _reg_shape(n, vec, items * vec, block_max)
    values = items * vec
    # 16-byte vectors only: rows of narrower ones lost to one block or the ring tier (bf16
    # N=16386, 2-element vectors: 1317 GB/s against 1943; float32 N=8193: 1465 against 2455)
    split = _fwd_reg_cluster(n, vec, values, shape, max_cluster) if wide16 and not wide else None
    if split is not None:
        cluster, items, block, minb, smem, lag = _fwd_staged(
            split, vec, w_dtype, b_dtype, x_dtype, smem_limit
        )
        args = (tx, tw, tb, vec, items, block, cluster, minb, smem > 0, lag)
        expr = _compile.template("ln_fwd_reg_cluster", *args)
        return Plan(_compile.FWD_SOURCE, expr, "reg", vec, items, block, block, 1, smem, cluster)
    ring_split = _fwd_cluster(n, vec, x_dtype.itemsize, row_bytes, smem_limit, max_cluster)
    if ring_split is not None:
        cluster, b, smem = ring_split
        expr = _compile.template("ln_fwd_cluster", tx, tw, tb, vec, b, cluster)
        return Plan(_compile.FWD_SOURCE, expr, "cluster", vec, 0, b, b, 1, smem, cluster)
    if shape is not None:
        acc = acc_dtype(x_dtype).itemsize
        centered = _reg_shape(n, vec, min(values, FWD_CENTER_BYTES // acc), block_max)
        exact = False  # a row of a warp or less in the slots its packs fill (FWD_CENTER_EXACT)
        if FWD_CENTER_EXACT and sixteen and centered and centered[0] <= 32:
            tpr, slots, block = centered
            if n % (tpr * vec) == 0 and n // (tpr * vec) < slots:
                centered, exact = (tpr, n // (tpr * vec), block), True
        in_place = acc == x_dtype.itemsize  # double: centered in the loaded registers
        center = (
            x_dtype.itemsize != 4
            and centered is not None
            and (in_place or centered[2] <= FWD_CENTER_BLOCK)
            and _cdiv(n, centered[0] * vec) == centered[1]  # every slot holds a pack
        )
        tpr, items, block = centered if center else shape
        lean = sixteen and not center and items == FWD_REG_ITEMS_SHORT and tpr > 32
        if center:
            wave = exact or (one_wave and max_cluster > 1)  # sm_90: 1024 threads an SM
            threads = FWD_REG_THREADS if wave else FWD_CENTER_THREADS
        else:
            threads = FWD_LEAN_THREADS if lean else FWD_REG_THREADS
        minb = 1 if wide else max(1, threads // block)
        whole = min(items, n // (tpr * vec)) if center and acc > x_dtype.itemsize else 0
        args = (tx, tw, tb, vec, items, tpr, block, minb, center, whole)
        expr = _compile.template("ln_fwd_reg", *args)
        rows = block // tpr
        bounds = 0 if wide else minb * block
        return Plan(_compile.FWD_SOURCE, expr, "reg", vec, items, tpr, block, rows, 0, 1, bounds)
    ring = _ring_shape(row_bytes, smem_limit) if _async_copyable(vec, x_dtype.itemsize) else None
    if ring is not None:
        block, smem = ring
        expr = _compile.template("ln_fwd_ring", tx, tw, tb, vec, block, block)
        return Plan(_compile.JAG_SOURCE, expr, "ring", vec, 0, block, block, 1, smem)
    stage = row_bytes <= smem_limit - STATIC_SMEM_MARGIN
    alone = not stage or 2 * (row_bytes + STATIC_SMEM_MARGIN) > smem_limit
    block = ROW_BLOCK_ALONE if alone else ROW_BLOCK
    expr = _compile.template("ln_fwd_row", tx, tw, tb, vec, block, stage)
    smem = row_bytes if stage else 0
    return Plan(_compile.FWD_SOURCE, expr, "row", vec, 0, block, block, 1, smem)


def _fwd_stream(n: int, vec: int):
    """(threads a row, packs a thread, partial) of the forward's stream tier for rows of N in
    packs of VEC (module notes): two packs a thread in the fewest warps, up to FWD_STREAM_PAIRS
    threads, where the row fills them (partial: in FWD_STREAM_PARTIAL threads, FWD_STREAM_FILL
    of them); else the first of FWD_STREAM_SHAPES whose threads split the row's packs evenly
    into one of its counts; else the first of FWD_STREAM_EVEN that splits them evenly over
    FWD_STREAM_EVEN_LEAST threads or more, a multiple of 32; else None."""
    packs, rest = divmod(n, vec)
    if rest:
        return None
    tpr = 32 * _cdiv(packs, 64)
    if packs > 32 and tpr <= FWD_STREAM_PAIRS:
        if packs == 2 * tpr:
            return tpr, 2, False
        if tpr == FWD_STREAM_PARTIAL and packs >= FWD_STREAM_FILL * 2 * tpr:
            return tpr, 2, True
    for tpr, steps in FWD_STREAM_SHAPES:
        if packs % tpr == 0 and packs // tpr in steps:
            return tpr, packs // tpr, False
    for steps, most in FWD_STREAM_EVEN:
        tpr, left = divmod(packs, steps)
        if not left and tpr % 32 == 0 and FWD_STREAM_EVEN_LEAST <= tpr <= most:
            return tpr, steps, False
    return None


def _fwd_reg_cluster(n: int, vec: int, values: int, shape, max_cluster: int):
    """(blocks per cluster, items, threads) of the forward's register tier split over a
    thread-block cluster: None where one block of at most FWD_REG_CLUSTER_BLOCK threads holds
    the row (``shape``, the one-block register shape, or None), else the fewest blocks (up to
    ``max_cluster`` and FWD_REG_CLUSTER_MAX) whose slices of the row fit such blocks at
    ``values`` values a thread."""
    if shape is not None and shape[2] <= FWD_REG_CLUSTER_BLOCK:
        return None
    cluster = 2
    while cluster <= min(max_cluster, FWD_REG_CLUSTER_MAX):
        got = _reg_shape(_slice_packs(n, vec, cluster) * vec, vec, values, FWD_REG_CLUSTER_BLOCK)
        if got is not None and got[0] == got[2] > 32:  # a block per slice
            return cluster, got[1], got[2]
        cluster *= 2
    return None


def _fwd_staged(split, vec: int, w_dtype, b_dtype, x_dtype, smem_limit: int):
    """(blocks per cluster, items, threads, blocks per SM, dynamic shared bytes, two rows a
    block) of a forward register cluster ``split`` (_fwd_reg_cluster): shared bytes for w's and
    b's slices where they fit FWD_STAGE_WB_SM (or the device's ``smem_limit``, if less) at the
    blocks per SM of the launch bounds; float32 rows in blocks of FWD_LAG_BLOCK threads or more
    at one block an SM, holding two rows; other float32 rows at fewer blocks per SM (two or
    more), or over twice the blocks of half the threads (module notes); else 0 (w and b read
    through L1)."""
    cluster, items, block = split
    minb = max(1, FWD_REG_THREADS // block)
    smem = items * block * vec * (w_dtype.itemsize + b_dtype.itemsize)
    room = min(FWD_STAGE_WB_SM, smem_limit)
    fits = room // (smem + STATIC_SMEM_MARGIN)  # blocks per SM whose copies fit
    if x_dtype.itemsize == 4 and block >= FWD_LAG_BLOCK and fits >= 1:
        return cluster, items, block, 1, smem, True
    if fits >= minb:
        return cluster, items, block, minb, smem, False
    if x_dtype.itemsize == 4 and fits >= 2:
        return cluster, items, block, fits, smem, False
    if x_dtype.itemsize == 4 and cluster == 2 and block % 64 == 0:
        half = smem // 2
        per_sm = min(2 * minb, room // (half + STATIC_SMEM_MARGIN))
        if per_sm >= 2:
            return 4, items, block // 2, per_sm, half, False
    return cluster, items, block, minb, 0, False


def _share(smem_limit: int, blocks: int = 1) -> int:
    """Dynamic shared bytes of each of ``blocks`` blocks sharing an SM (16-byte multiple)."""
    return (smem_limit // blocks - STATIC_SMEM_MARGIN) // 16 * 16


def _async_copyable(vec: int, itemsize: int) -> bool:
    """cp.async copies packs of 4, 8 or 16 bytes (ring.cuh)."""
    return vec * itemsize >= 4


def _fwd_cluster(n: int, vec: int, itemsize: int, row_bytes: int, smem_limit: int,
                 max_cluster: int):  # fmt: skip
    """(blocks per cluster, threads, dynamic shared bytes) of the forward's cluster tier: None
    while one block's ring holds the row of ``row_bytes`` staged bytes (or no cluster fits, or
    cp.async cannot copy the packs), else the fewest blocks whose rings hold FWD_CLUSTER_ROWS
    rows of slices when FWD_CLUSTER_SPLIT blocks share an SM."""
    share = _share(smem_limit, FWD_CLUSTER_SPLIT)
    if not _async_copyable(vec, itemsize) or row_bytes <= _share(smem_limit):
        return None
    block = FWD_CLUSTER_BLOCK if FWD_CLUSTER_SPLIT == 1 else FWD_CLUSTER_BLOCK_SPLIT
    cluster = 2
    while cluster <= max_cluster:
        slice_bytes = _staged(_slice_packs(n, vec, cluster) * vec, itemsize)
        if FWD_CLUSTER_ROWS * slice_bytes <= share:
            return cluster, block, share
        cluster *= 2
    return None


def _ring_shape(nbytes: int, smem_limit: int):
    """(threads, dynamic shared bytes) of a ring-tier block whose one ring holds ``nbytes``,
    exactly one row: the most blocks per SM (up to RING_SPLIT) whose shares of the shared memory
    hold it; None when not even one block's does."""
    for k in range(RING_SPLIT, 0, -1):
        if nbytes <= _share(smem_limit, k):
            return (RING_BLOCK_SPLIT if k == RING_SPLIT else RING_BLOCK), nbytes
    return None


def _bwd_slice_rows(n: int, vec: int, itemsize: int, values: int, share: int, cluster: int):
    """(items, rows, bytes) of a backward ring block whose cluster of ``cluster`` blocks shares
    each row: ITEMS, how many rows of x and dy slices its ring of ``share`` bytes holds, and the
    bytes of one; None when the slice's dw/db accumulators do not fit the registers or one row
    does not fit."""
    packs = _slice_packs(n, vec, cluster)
    items = _cdiv(packs, BWD_RING_BLOCK)
    regs = items * vec <= 2 * values and items <= 2 * MAX_ITEMS  # 32 scalar slots spill
    row_bytes = 2 * _staged(packs * vec, itemsize)
    rows = share // row_bytes
    return (items, rows, row_bytes) if regs and rows >= 1 else None


def _bwd_ring_shape(n: int, vec: int, itemsize: int, values: int, share: int, max_cluster: int):
    """(cluster, items, lag, shared bytes) of the backward's ring tier (cluster 1) or cluster
    tier: the smallest cluster (up to ``max_cluster``) whose blocks fit their slices; lag 1
    (the next row's pass 1 overlaps the cluster's exchange) where the ring holds two rows of
    slices. The ring is sized to whole rows of slices: what it leaves of the SM's 256 KB is L1,
    where w stays (one block per SM either way: its registers take the register file). None
    when no cluster fits or cp.async cannot copy the packs."""
    if not _async_copyable(vec, itemsize):
        return None
    cluster = 1
    while cluster <= max_cluster:
        got = _bwd_slice_rows(n, vec, itemsize, values, share, cluster)
        if got is not None:
            items, rows, row_bytes = got
            lag = int(cluster > 1 and rows >= 2)
            return cluster, items, lag, rows * row_bytes
        cluster *= 2
    return None


def _bwd_reg_cluster(n: int, vec: int, max_cluster: int):
    """(blocks per cluster, (tpr, items, block)) of the backward's register tier for rows no
    block holds, split over a thread-block cluster, a block per column slice: the fewest blocks
    (2, 4 or 8, up to ``max_cluster``) of BWD_REG_CLUSTER_ITEMS vectors a thread in at most
    BWD_REG_CLUSTER_BLOCK threads (in steps of a warp, at least BWD_REG_CLUSTER_LEAST); None
    when none holds the row. Each block holds two rows (ln_bwd_reg_cluster overlaps a row's
    wait for the cluster's sums with the next row's first pass) at 512 threads an SM. H200,
    M*N = 2**27, `cupyln bench` against the clusters before (the fewest blocks of up to 512
    threads of 2 vectors that waited for each row's sums), back to back on one GPU, bf16 / fp16
    GB/s: N=32768 (4 x 256) 3603 / 3524 against 3086 / 3189, 65536 (8 x 256) 3586 / 3525
    against 3126 / 3185, 28672 (4 x 224) 3254 / 3328 against 2997 / 3097, 57344 (8 x 224) 3224
    / 3379 against 3109 / 3141; blocks of 160 and 192 threads from 4.4% behind (N=20480, 4 x
    160: 3136 / 3072 against 3271 / 3215) to 8.6% ahead (fp16 49152, 8 x 192: 3267 against
    3008; the kernel has every width). Clusters of 3, 5, 6 and 7 blocks of 256 threads,
    measured with three exchange slots (kernels/cluster.cuh), were ahead at some widths and
    behind at others, and two blocks of 256 at N=16384 measured 3365 against 3776 for the lone
    block of 512 threads that holds the row."""
    values = BWD_REG_CLUSTER_ITEMS * vec
    cluster = 2
    while cluster <= max_cluster:
        slice_n = _slice_packs(n, vec, cluster) * vec
        got = _reg_shape(slice_n, vec, values, BWD_REG_CLUSTER_BLOCK, step=32)  # a warp's steps
        if got is not None and got[0] == got[2] >= BWD_REG_CLUSTER_LEAST:
            return cluster, got
        cluster *= 2
    return None


def _bwd_small_block(n: int, vec: int, values: int):
    """(vec, (tpr, items, block)) of a 16-bit backward row in ``vec``-element packs whose
    register block has fewer than BWD_REG_AHEAD_BLOCK threads: rows of up to a warp in the
    fewest threads (a power of two) that hold them, wider rows in a block of their own sized in
    steps of a warp (not REG_BLOCK_STEP); each thread gets only the packs the row needs, and
    packs of half the width are taken where they leave fewer of the slots empty (ties keep the
    wider). The launch bounds give such rows 768 threads an SM, so fewer idle threads a row put
    more rows in flight (N=1280: 8 rows of 96 threads an SM instead of 6 of 128), and warps of
    equal work reach the row's barriers together (N=768: every warp 3 packs of 4 elements
    instead of 2 and 1 packs of 8). H200, M*N = 2**27, one process, best of 3, bf16 / fp16 GB/s
    against the plans before: N=768 3559 / 3631 at 64 threads x 3 packs of 4 against 3254 /
    3394 at 64 x 2 packs of 8; 1152 3335 / 3454 at 96 x 3 of 4 against 2917 / 3035 at 128 x 2
    of 8; 1280 3472 / 3561 at 96 x 2 of 8 against 3113 / 3223; 1536 3691 / 3777 against 3297 /
    3404; every width of N=520-1536 gained 7-15%. Rows of up to a warp: N=384 3663 / 3753 at
    32 threads x 3 packs of 4 against 3417 / 3431 at 32 x 2 of 8, 320 3269 / 3400 against 3012
    / 3026, 160 3186 / 3343 against 2969 / 3018 (16 x 3 of 4), 48 3631 / 3726 against 3411 /
    3448; N=16-384 gained 4.5-21%, 256, 448 and 512 kept their plans. Past N=1536 (2560, 3584,
    4608, 5120 in blocks of 160-448 threads, packs of 4 or blocks in steps of a warp) they lost
    by up to 17%, or tied."""
    best = None
    for v in (vec, vec // 2):
        tpr, _, block = _reg_shape(n, v, values, REG_BLOCK_MAX, step=32)
        items = _cdiv(_cdiv(n, v), tpr)  # the packs the row needs, not a power of two
        empty = tpr * items * v - n
        if best is None or empty < best[0]:
            best = empty, v, (tpr, items, block)
    return best[1:]


def _bwd_group_block(tpr: int, values: int, short: bool = False) -> int:
    """The block of the backward's 16-bit register rows of ``tpr`` threads (more than a warp,
    under BWD_REG_AHEAD_BLOCK) of ``values`` elements of x a thread: BWD_GROUP_BLOCK threads
    where ``tpr`` divides it and ``values`` <= BWD_GROUP_VALUES (BWD_GROUP_SHORT_VALUES in a
    ``short`` launch), each row group synchronised by its own named barrier, so that one block
    writes one dw/db partial row for several rows (N=768: 528 partial rows instead of 2112);
    other rows keep a block each. H200, M*N = 2**27, one process, best of 3, GB/s against a
    block a row: bf16 N=520 2881 / 2677, 576 3114 / 2922, 640 3408 / 3233, 704 3382 / 3373,
    768 3622 / 3566 (a second run 3613 / 3571); fp16 640 3544 / 3357, 768 3742 / 3666 (3741 /
    3657); bf16 M=3000 N=768 990 / 905, fp16 M=16384 N=768 2360 / 2202. At 768 threads an SM
    (70 registers) N=768 lost instead (3325 / 3576).
    Rows of 2 packs of 8 (N=776-1024 in 64 threads, 1544-2048 in 128; 768 threads an SM) are
    grouped in short launches only: at M*N = 2**27 fp16 lost 1.2-3.1% (best of 5: N=832 3393 /
    3501, 1000 3684 / 3774, 1024 3804 / 3855, 2048 3749 / 3796; bf16 -0.3% .. +0.4%), where
    short launches gained, best of 5: fp16 M=1024 N=1024 585 / 517, M=4096 1480 / 1300, 8192
    1926 / 1841, 12288 2447 / 2254; bf16 M=4096 N=832 1250 / 1133, 12288 2126 / 1980; fp16
    M=4096 N=2048 1858 / 1768, bf16 M=1024 N=2048 859 / 792 (+3.5% to +15.9% at N=832-1024,
    M=1024-12288; +4.1% to +8.5% at N=2048, M=1024-4096). Rows of 96 threads lost in blocks of
    192 (N=1040 2527 / 3108, 1152 2789 / 3346)."""
    most = BWD_GROUP_SHORT_VALUES if short else BWD_GROUP_VALUES
    return BWD_GROUP_BLOCK if BWD_GROUP_BLOCK % tpr == 0 and values <= most else tpr


def _bwd_fill_sm(block: int, items: int, shared: bool, smem, smem_limit: int) -> int:
    """The block of a backward 16-bit row that shares its SM with others (a block per row): the
    smallest size that splits the launch bounds' threads per SM evenly among as many blocks, so
    that none of them go unused (320 -> 384 threads, 2 blocks of 768; with the sums in shared
    memory 448 -> 512, 2 of 1024), where the SM's shared memory holds the larger blocks
    (``smem(block, items, shared)`` bytes each). The padded slots are predicated off. H200, M*N =
    2**27, one process, best of 3, bf16 / fp16 GB/s: N=4160 3230 -> 3329 / 3252 -> 3354, 4608
    3229 -> 3476 / 3243 -> 3422, 5120 3238 -> 3625 / 3244 -> 3552 (80 registers a thread instead
    of 92 at 2 blocks of 320), 6656 3300 -> 3432 / 3284 -> 3467, 7168 3284 -> 3492 / 3317 ->
    3552. A lone block does not grow (N=10240 at 1024 threads instead of 640: 2770 against 3380
    GB/s, 12288 2995 / 3238), nor do the register clusters' blocks (N=20480 at 4 x 384 instead
    of 4 x 320: 2365 / 2338, fp16 2318 / 2348)."""
    threads = BWD_SHARED_SUMS_THREADS if shared else BWD_REG_THREADS
    blocks = threads // block
    if blocks < 2:
        return block
    grown = threads // blocks
    fits = blocks * (smem(grown, items, shared) + STATIC_SMEM_MARGIN) <= smem_limit
    return grown if fits else block


def backward_plan(n: int, x_dtype, w_dtype, vec: int, smem_limit: int,
                  max_cluster: int = 1, short: bool = False) -> Plan:  # fmt: skip
    """Kernel variant computing dx (and, in the register, ring and cluster tiers, the dw/db
    partials); ``max_cluster``: the largest thread-block cluster the device runs (1: none);
    ``short``: for a launch whose grid stays short of the resident blocks (backward_short)."""
    tx, tw = ctype(x_dtype), ctype(w_dtype)
    values = BWD_REG_VALUES * 4 // acc_dtype(x_dtype).itemsize
    shape = _reg_shape(n, vec, values, REG_BLOCK_MAX)
    # 16-bit rows in 16-byte packs (narrower packs, more of them, spill under the bounds)
    packs16 = x_dtype.itemsize == 2 and vec == 8

    def reg_smem(block, items, shared, staged=False, tpr=None, ahead=None):
        """Dynamic shared memory: x and dy of the next row (AHEAD: blocks of
        BWD_REG_AHEAD_BLOCK threads and up, or as ``ahead`` says), the dw/db sums (shared), w
        (staged: one copy a block, a row's worth of ``tpr`` threads)."""
        values = block * items * vec
        smem = 2 * values * acc_dtype(x_dtype).itemsize if shared else 0
        if ahead is None:
            ahead = block >= BWD_REG_AHEAD_BLOCK
        if ahead:
            smem += 2 * values * x_dtype.itemsize
        w_values = (tpr or block) * items * vec
        return smem + (w_values * w_dtype.itemsize if staged else 0)

    def stage_w(block, items, shared, threads=None):
        """Whether the block copies its columns of w into shared memory once (STAGE_W): 16-bit
        register rows with w of x's dtype; blocks that copy the next row ahead where the SM
        still holds as many of them as ``threads`` an SM (the launch bounds') allow."""
        if not packs16 or w_dtype != x_dtype:
            return False
        if block < BWD_REG_AHEAD_BLOCK:
            return True

        def held(staged):  # blocks the SM's shared memory holds
            return smem_limit // (reg_smem(block, items, shared, staged) + STATIC_SMEM_MARGIN)

        threads = threads or (BWD_SHARED_SUMS_THREADS if shared else BWD_REG_THREADS)
        return held(True) >= min(held(False), max(1, threads // block))

    def block_smem(block, items, shared):
        return reg_smem(block, items, shared, stage_w(block, items, shared))

    def shared_sums(shape):
        """The shape, and whether its sums go to shared memory (16-bit rows in 16-byte packs,
        blocks of BWD_SHARED_SUMS_BLOCK and up that fit)."""
        if shape is None or not packs16:
            return shape, False
        fits = reg_smem(shape[2], shape[1], True) <= smem_limit - STATIC_SMEM_MARGIN
        return shape, shape[2] >= BWD_SHARED_SUMS_BLOCK and fits

    shared = False
    if packs16:
        wide, wide_shared = shared_sums(_reg_shape(n, vec, values, BWD_SHARED_SUMS_BLOCK_MAX))
        if wide_shared:
            shape, shared = wide, True
            # (512 threads of 4 vectors hold every row a block of 2 vectors a thread does)
            lone, lone_fits = shared_sums((BWD_LONE_BLOCK, BWD_LONE_ITEMS, BWD_LONE_BLOCK))
            if wide[2] > BWD_LONE_FROM and lone_fits:
                shape = lone
        elif wide is None:  # no block holds the row: a cluster of register blocks (sm_90)
            split = _bwd_reg_cluster(n, vec, min(max_cluster, BWD_REG_CLUSTER_MAX))
            if split is not None:
                cluster, (_, items, block) = split
                staged = stage_w(block, items, True, BWD_REG_CLUSTER_THREADS)
                args = (tx, tw, vec, items, block, cluster, staged)
                expr = _compile.template("ln_bwd_reg_cluster", *args)
                smem = reg_smem(block, items, True, staged, ahead=True)
                source = _compile.BWD_SOURCE
                return Plan(source, expr, "reg", vec, items, block, block, 1, smem, cluster)
    if shape is not None:
        tpr, items, block = shape
        if packs16 and block < BWD_REG_AHEAD_BLOCK:
            vec, (tpr, items, block) = _bwd_small_block(n, vec, values)
        if packs16 and tpr == block:
            tpr = block = _bwd_fill_sm(block, items, shared, block_smem, smem_limit)
        ahead = packs16 and block >= BWD_REG_AHEAD_BLOCK
        staged = stage_w(block, items, shared)
        smem = reg_smem(block, items, shared, staged, tpr) if packs16 else 0
        if packs16 and not ahead and tpr > 32:
            block = _bwd_group_block(tpr, items * vec, short)
        args = (tx, tw, vec, items, tpr, block, ahead, shared, staged)
        expr = _compile.template("ln_bwd_reg", *args)
        return Plan(_compile.BWD_SOURCE, expr, "reg", vec, items, tpr, block, block // tpr, smem)
    ring = _bwd_ring_shape(n, vec, x_dtype.itemsize, values, _share(smem_limit), max_cluster)
    if ring is not None:
        cluster, items, lag, smem = ring
        b = BWD_RING_BLOCK
        if cluster == 1:
            expr = _compile.template("ln_bwd_ring", tx, tw, vec, items, b)
        else:
            expr = _compile.template("ln_bwd_cluster", tx, tw, vec, items, b, cluster, lag)
        tier = "ring" if cluster == 1 else "cluster"
        return Plan(_compile.BWD_SOURCE, expr, tier, vec, items, b, b, 1, smem, cluster)
    row_bytes = 2 * _staged(n, x_dtype.itemsize)
    stage = row_bytes <= smem_limit - STATIC_SMEM_MARGIN
    block = ROW_BLOCK
    expr = _compile.template("ln_bwd_row", tx, tw, vec, block, stage)
    smem = row_bytes if stage else 0
    return Plan(_compile.BWD_SOURCE, expr, "row", vec, 0, block, block, 1, smem)


def dwdb_cols_expr(x_dtype) -> str:
    return _compile.template("ln_bwd_dwdb_cols", ctype(x_dtype))


def partial_reduce_shape(n: int, slices: int, sm_count: int) -> tuple[int, int]:
    """(C, Y) of ln_partial_reduce summing ``slices`` partial rows of N columns: blocks of (32, Y)
    threads over C columns each.
    C = 32 (a warp reads 128 bytes of one partial row), or 8 (a warp reads 32 bytes of each of
    4 rows) where even 4 times the blocks of 32 columns leave SMs idle. H200, bf16 M*N = 2**27,
    the backward with the reduce at (32, 8) threads, then (32, 32) at 32 columns, then at 8:
    N=512 3682 / 3750 / 3776 GB/s, 768 3056 / 3225 / 3262, 1024 3518 / 3711 / 3738, 2048 3577 /
    3674 / 3666, 4096 3596 / 3635 / 3596.
    Y = PARTIAL_REDUCE_Y, or PARTIAL_REDUCE_FEW_Y under PARTIAL_REDUCE_FEW partial rows: smaller
    blocks, more of them resident, each thread adding more rows. H200, M*N = 2**27, one process,
    best of 3, the backward's GB/s with Y = 8 there against 32 everywhere: bf16 N=12288 (132
    partial rows) 3390 -> 3442, 16384 (132) 3437 -> 3472, 32768 (62 clusters) 2737 -> 2796,
    65536 2704 -> 2802; fp16 12288 3402 -> 3449, 16384 3404 -> 3457, 32768 2714 -> 2773; fp16
    M=4096 N=15872 3068 -> 3149, M=8192 N=5120 3037 -> 3089; float32 M=4096 N=32768 2823 ->
    2866; bf16 M=2048 N=4096 1833 -> 1811. The launches that kept Y = 32 read -0.3% .. +1.0%
    (bf16 N=5120, 264 partial rows: +1.0%, the run's noise). Y = 8 at every launch lost 1.2%
    at N=2048 and 4096 (792 and 396 partial rows)."""
    cols = 32 if 4 * _cdiv(n, 32) > sm_count else 8
    return cols, PARTIAL_REDUCE_FEW_Y if slices < PARTIAL_REDUCE_FEW else PARTIAL_REDUCE_Y


def reduce_expr(x_dtype, dw_dtype, db_dtype, cols: int, y: int) -> str:
    """ln_partial_reduce of ``cols`` columns and (32, ``y``) threads a block
    (partial_reduce_shape)."""
    acc = ctype(acc_dtype(x_dtype))
    return _compile.template("ln_partial_reduce", acc, ctype(dw_dtype), ctype(db_dtype), y, cols)


def dwdb_slices(m: int, n: int, sm_count: int) -> tuple[int, int]:
    """(slices, rows per slice) for ln_bwd_dwdb_cols: about 8 blocks per SM in all, each
    block walking at least 8 rows per thread-row."""
    col_blocks = _cdiv(n, REDUCE_BLOCK[0])
    slices = max(1, min(_cdiv(m, 64), _cdiv(8 * sm_count, col_blocks)))
    per = _cdiv(m, slices)
    return _cdiv(m, per), per


def backward_short(m: int, plan: Plan, capacity: int) -> bool:
    """Whether a backward of M rows in ``plan`` (``capacity`` resident blocks) is a short launch:
    its blocks of BWD_MIN_STEPS groups of rows would not fill the resident blocks
    (backward_grid), so the partial rows and their reduce weigh more."""
    return m < plan.rows * BWD_MIN_STEPS * capacity


def backward_grid(m: int, plan: Plan, capacity: int, sm_count: int) -> int:
    """Blocks (clusters) of a backward with one dw/db partial row each: every block walks at
    least BWD_MIN_STEPS groups of rows, so short batches write fewer partial rows. A grid of
    single blocks short of the resident capacity then grows to the first of BWD_FILL (threads an
    SM, steps a block) whose threads leave every block at least that many steps, so that no SM
    idles: 512 threads an SM where each block still walks three groups of rows, else 256; to
    whole blocks an SM where that shortens the most loaded SM's walk (1151 rows in
    144 blocks leave 12 SMs two blocks of 8 steps, in 264 every SM two of 5); and last to the
    fewest blocks that walk as many steps (the partial rows cost traffic and, in
    ln_partial_reduce, rounds of loads).
    H200, one process, best of 3, GB/s against BWD_MIN_STEPS alone, on shapes apart from those
    the rule was drawn from: fp16 M=640 N=640 165 -> 253, 640 x 4608 955 -> 1069, 640 x 10240
    1238 -> 1457, 1280 x 1280 566 -> 691, 2560 x 640 575 -> 732, 2560 x 2560 1456 -> 1489, 5000
    x 640 1027 -> 1118; bf16 512 x 1024 192 -> 287, 2048 x 2048 1115 -> 1220, 1151 x 8192 1410
    -> 1652, 3000 x 768 738 -> 926, 8192 x 512 1347 -> 1480; float32 1024 x 4096 1803 -> 2007,
    2000 x 2000 1725 -> 1860, 4096 x 1024 1898 -> 1964; float64 2048 x 1024 1872 -> 2039; the
    other grids of 42 shapes within -0.6% .. +1.9%. Tried on the shapes it was drawn from: 4
    steps alone lost at fp16 1024 x 8192 (1717 against 1576) and bf16 2048 x 4096 (1825 /
    1727); 2 and 1 step lost on narrow rows (fp16 2048 x 1024: 752 and 634 against 860 at 4);
    256 threads alone left 5-12% at fp16 8192 x 512, 2048 x 2048 and 3000 x 768; 512 threads
    alone lost 6-16% where blocks then walked 1 or 2 steps (fp16 512 x 2048 412 against 467,
    2048 x 1024 718 / 827)."""
    g = grid_size(m, plan.rows * BWD_MIN_STEPS, capacity)
    if plan.cluster > 1 or g >= capacity:
        return g
    steps = lambda g: _cdiv(m, plan.rows * g)  # noqa: E731  (of the blocks that walk most)
    for threads, least in BWD_FILL:
        fill = min(capacity, sm_count * max(1, threads // plan.block))
        if steps(fill) >= least:
            break
    g = max(g, fill)
    whole = min(capacity, _cdiv(g, sm_count) * sm_count)
    if _cdiv(whole, sm_count) * steps(whole) < _cdiv(g, sm_count) * steps(g):
        g = whole
    return max(1, _cdiv(m, plan.rows * steps(g)))


def forward_grid(m: int, plan: Plan, capacity: int) -> int:
    """Blocks of a forward launch: the register and stream tiers' single blocks take a block
    per group of rows (the stream tier's: one row, or FWD_STREAM_WARP_BLOCK / 32 rows of a
    warp) and let the hardware schedule them as resident blocks finish (bf16 N=16384 3831 GB/s
    against 3459 for a persistent grid, N=512 3863 / 3560); the register tier's clusters and
    the staging tiers keep persistent grids (``capacity`` resident blocks, or clusters):
    clusters that walk rows measured faster than a cluster per row (H200, M*N = 2**27: bf16
    N=65536 3269 against 2887 GB/s, fp16 3244 / 2923; kernels/layer_norm_fwd.cu,
    ln_fwd_reg_cluster)."""
    if plan.tier in ("reg", "stream") and plan.cluster == 1:
        return max(1, min(_cdiv(m, plan.rows), MAX_GRID))
    return grid_size(m, plan.rows, capacity) * plan.cluster


def grid_size(m: int, rows_per_block: int, capacity: int) -> int:
    """Blocks for M rows: one per group of rows, at most the resident capacity (persistent).
    For a plan of thread-block clusters: clusters, and ``capacity`` in clusters."""
    return max(1, min(_cdiv(m, rows_per_block), capacity))


# ------------------------------------------------------------------ jagged (kernels/jagged.cu)
# Forward short path: persistent blocks whose shared memory is staging rings, one ring per group
# of threads (the block, or each warp when a sequence of max_seqlen rows fits a warp's share:
# many small sequences in flight at once).
# Block groups: JAG_RING_SPLIT blocks of JAG_RING_BLOCK threads share an SM where a sequence of
# max_seqlen rows fits a third of the shared memory, else one block of JAG_RING_BLOCK_ALONE
# (scripts/tune_jagged.py, B = 16384, D = 256: bf16 3438 GB/s at 3 x 256 threads against 2753 at
# 1 x 256; fp32 3618 at 1 x 512 against 3522 at 1 x 256).
JAG_RING_BLOCK = 256
JAG_RING_BLOCK_ALONE = 512
JAG_RING_SPLIT = 3
JAG_RING_WARPS = (16, 8)  # warps per block tried, in order, for warp-per-sequence groups
# Backward block-per-sequence kernel (scripts/tune_jagged.py, Helion batches B = 16384,
# lengths 1..128): 256 threads with 4 loads in flight each where several blocks share an SM;
# 512 threads with 8 loads in flight where the staged sequence leaves room for one block per SM.
JAG_BLOCK = 256
JAG_UNROLL = 4
JAG_BLOCK_ALONE = 512
JAG_UNROLL_ALONE = 8
JAG_CHUNK_BLOCK = 256  # chunk kernels of the long path
JAG_DEFAULT_SMEM = 96 * 1024  # backward: staged bytes per block without a max_seqlen hint


@dataclass(frozen=True)
class JaggedPlan:
    """Launch shape of the jagged kernels for one (D, dtype, vector width, max_seqlen).

    ``cap``: elements a sequence (forward) or each of x and dy (backward) may have to take the
    short path; ``rows``: rows per chunk of the long path (2 * rows * D <= cap, or 1);
    ``smem``: dynamic shared bytes of the short kernel, run with ``block`` threads. Forward:
    ``group`` threads per sequence (``block`` or 32), each group with a ring of ``ring``
    packs of the vector width. Backward: ``unroll`` loads in flight per thread."""

    cap: int
    rows: int
    smem: int
    block: int
    group: int = 0
    ring: int = 0
    unroll: int = 1


def _jagged_rows(cap: int, d: int) -> int:
    return max(1, cap // (2 * d))


def jagged_plan(d: int, x_dtype, vec: int, smem_limit: int, max_seqlen, backward: bool):
    """Shared memory and threads of the short path. Forward: rings fill the usable shared
    memory of one block per SM, or of JAG_RING_SPLIT blocks when a sequence of ``max_seqlen``
    rows fits their share; ``cap`` is what such a sequence needs when the caller gives that
    bound (longer sequences take the long path), else the ring. Backward: exactly what x and dy
    of ``max_seqlen`` rows need (more blocks per SM for short sequences), else
    JAG_DEFAULT_SMEM; never past the device's opt-in limit."""
    usable = smem_limit - STATIC_SMEM_MARGIN
    item = x_dtype.itemsize
    hint = max_seqlen * d if max_seqlen else None
    if not backward:
        pack = vec * item
        warps = [w for w in JAG_RING_WARPS if hint and hint * item * w <= usable]
        if warps:
            block, group, share = 32 * warps[0], 32, usable
        else:
            shares = [_share(smem_limit, k) for k in range(JAG_RING_SPLIT, 0, -1)]
            share = next(m for m in shares if not hint or hint * item <= m or m == shares[-1])
            block = group = JAG_RING_BLOCK_ALONE if share == shares[-1] else JAG_RING_BLOCK
        groups = block // group
        ring = share // groups // pack
        cap = ring * vec if hint is None else min(hint, ring * vec)
        return JaggedPlan(cap, _jagged_rows(cap, d), ring * pack * groups, block, group, ring)
    want = 2 * _staged(hint, item) if hint else JAG_DEFAULT_SMEM
    smem = min(want, usable) // 32 * 32
    cap = smem // 2 // item
    alone = 2 * (smem + STATIC_SMEM_MARGIN) > smem_limit
    block, unroll = (JAG_BLOCK_ALONE, JAG_UNROLL_ALONE) if alone else (JAG_BLOCK, JAG_UNROLL)
    return JaggedPlan(cap, _jagged_rows(cap, d), smem, block, unroll=unroll)


def jagged_exprs(x_dtype, w_dtype, b_dtype, offsets_ctype: str, vec: int, fwd: JaggedPlan,
                 bwd: JaggedPlan) -> dict:  # fmt: skip
    """Template instantiations of kernels/jagged.cu for one problem, by role (``fwd``/``bwd``:
    the plans giving the short kernels' shapes)."""
    tx, tw, tb, acc = ctype(x_dtype), ctype(w_dtype), ctype(b_dtype), ctype(acc_dtype(x_dtype))
    i, cb = offsets_ctype, JAG_CHUNK_BLOCK
    t = _compile.template
    return {
        "partition": t("jag_partition", i),
        "fwd_short": t("jag_fwd_short", tx, tw, tb, i, vec, fwd.block, fwd.group),
        "fwd_partial": t("jag_fwd_partial", tx, i, vec, cb),
        "fwd_combine": t("jag_combine", acc, i, True, cb),
        "fwd_apply": t("jag_fwd_apply", tx, tw, tb, i, vec, cb),
        "bwd_short": t("jag_bwd_short", tx, tw, i, vec, bwd.block, max(1, bwd.unroll // 2)),
        "bwd_partial": t("jag_bwd_partial", tx, tw, i, vec, cb),
        "bwd_combine": t("jag_combine", acc, i, False, cb),
        "bwd_apply": t("jag_bwd_apply", tx, tw, i, vec, cb),
        "expand": t("jag_expand_stats", acc, i),
    }


def jagged_check_expr(offsets_ctype: str) -> str:
    """The offsets check of kernels/jagged.cu (run before a plan is chosen)."""
    return _compile.template("jag_check_offsets", offsets_ctype)
