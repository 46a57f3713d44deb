"""Documented defaults, in one place. Every tunable elsewhere refers here.

Units are in the names: ``_S`` seconds, ``_STEPS`` steps, ``_ENTRIES`` stream entries.
"""

from __future__ import annotations

# --- Redis -------------------------------------------------------------------
#: Environment variable holding the Redis URL (``redis://``, ``rediss://``, ``unix://``).
REDIS_URL_ENV = "TRAINHEALTH_REDIS_URL"
#: ``online`` (default) or ``disabled``: whether :func:`trainhealth.init` sends anything (as W&B's WANDB_MODE).
MODE_ENV = "TRAINHEALTH_MODE"
#: Environment variable overriding the embedded server's home (data, pid, port files).
HOME_ENV = "TRAINHEALTH_HOME"
#: Embedded server's default home, under the user's home directory.
HOME_DIR = "~/.trainhealth"
#: Port the embedded redis-server tries first; the next free port is taken if it is busy.
EMBEDDED_PORT = 6390
#: Seconds to wait for the embedded redis-server to answer PING after starting it.
EMBEDDED_START_TIMEOUT_S = 10.0

# --- Streams and retention -----------------------------------------------------
#: Step records kept per run in the step stream: the detector service trims the entries it has read to this many
#: records (``XTRIM MINID``, detectors/retention.py), whatever the batching; each collector's ``XADD MAXLEN`` of as
#: many entries is a backstop for when no service reads. Measured 306 B of Redis memory a timed record (3 sections,
#: 6 metrics) in 1,000-record entries, 366 B at one record an entry (``bench/stream_memory.py``, BENCHMARKS.md):
#: 1,000,000 records ≈ 300-370 MB per run.
STEPS_RETENTION_RECORDS = 1_000_000
#: And in bytes of entries (their fields' text, which is what Redis stores, plus its ~5-20 % of overhead): the
#: service's trim also keeps at most this many, so fat records (many sections or metrics) cannot take the stream
#: past it whatever their count. 512 MiB binds only above ~540 B a record; the measured timed record is 250-300 B
#: of JSON.
STEPS_RETENTION_BYTES = 512 * 2**20
#: Approximate maximum entries kept in the events (and anomaly_log), per-step aggregate and ledger streams.
EVENTS_RETENTION_ENTRIES = 100_000
AGG_RETENTION_ENTRIES = 200_000
LEDGER_RETENTION_ENTRIES = 20_000
#: And bytes of entries (field names and values: what Redis stores, plus ~1-5 % for entries this big) kept in the
#: per-step aggregate stream ``th:{run}:agg``, about: the service trims it at each XADD to the entries of the newest
#: one's size that fit (detectors/retention.py). An entry carries every rank's busy seconds, ~10 B a rank, so the
#: 200,000 entries above would be ~8 GB at 4,096 ranks. 256 MiB keeps ~6,500 steps at 4,096 ranks (3.6 h at 2 s a
#: step), ~26,000 at 1,024, all 200,000 below ~130 ranks: more than the dashboard's per-step pages read
#: (DASHBOARD_STEPS) and its zoom at full resolution for hours back; the whole run is drawn from the rollups.
AGG_RETENTION_BYTES = 256 * 2**20
#: Bytes of ledger snapshots kept in ``th:{run}:ledger``, about: a snapshot is 1-3 kB (more with many badput causes),
#: so 64 MiB binds only above ~3.3 kB a snapshot; the entry bound keeps ~11 h of 2-s snapshots.
LEDGER_RETENTION_BYTES = 64 * 2**20
#: Bytes of anomaly transitions kept in ``th:{run}:anomaly_log``, about: each entry carries its anomaly's JSON (~1 kB;
#: tens of kB for a straggler of many ranks), so its 100,000-entry bound alone could reach gigabytes.
ANOMALY_LOG_RETENTION_BYTES = 64 * 2**20
#: Steps per entry of the per-step rollup ``th:{run}:agg:rollup`` (detectors/rollup.py), kept for the whole run: the
#: whole-run charts of a run longer than the per-step stream holds read it. 100 steps a bucket: a 1,000,000-step run
#: is 10,000 entries (~4 MB), which a chart reduces to its 2,000 points per curve (MinMaxLTTB on the buckets'
#: extremes, so a one-step spike stays).
ROLLUP_STEPS = 100
#: Steps per bucket of each rollup level the service writes, each its own stream kept for the whole run
#: (``RunKeys.rollup(every)``; the 100-step level is ``th:{run}:agg:rollup``). Measured (BENCHMARKS.md, "Retention"):
#: a 30-day run at one step per 2 s is 1,296,000 steps; its whole-run chart read 12,960 per-100 buckets (9.2 MB,
#: 0.5-1.2 s) but 1,296 per-1,000 ones (0.9 MB, 0.11 s); the per-10 level gives a zoom into steps the per-step stream
#: no longer holds ten times the resolution (2,000 steps: 200 buckets, not 20) for ~40 MB a 30-day run. The dashboard
#: reads the finest level with at most ``ROLLUP_MAX_BUCKETS`` buckets in the range it draws.
ROLLUP_LEVELS = (10, 100, 1_000)
#: Rollup entries kept per run, about: 100,000,000 steps at ROLLUP_STEPS.
ROLLUP_RETENTION_ENTRIES = 1_000_000
#: Checkpoint saves and loads kept per run in ``th:{run}:checkpoints`` (detectors/checkpoints.py), the newest by
#: step: the whole-run charts' markers. One every 1,000 steps of a 1,000,000-step run, ~100 B each.
CHECKPOINTS_KEPT = 2_000
#: Sample indices a rank may log for one step (``log_step(sample_indices=)``); beyond it that step's indices of that
#: rank are not recorded (one warning). Covers a per-rank batch of 16,384 samples per optimizer step (OLMo 2's
#: 1,024-instance global batch is 128 per rank on 8 GPUs); a random permutation's indices cost ~8 bytes each on the
#: wire (128 KiB a record at the cap), a contiguous or strided block one ``[start, stop, step]`` range.
SAMPLE_INDICES_MAX = 16_384
#: Bytes of per-rank sample indices (their JSON text) kept per run in ``th:{run}:samples``, about: the service trims
#: the stream to the entries like the one it adds that fit (as the collectors bound the step stream). 256 MiB holds
#: ~6,000 steps of a 1,024-rank job logging 4 shuffled indices a rank (~43 KB a step), ~30,000 steps of 8 ranks logging
#: 128 shuffled ones each.
SAMPLE_INDICES_RETENTION_BYTES = 256 * 2**20
#: And at most this many steps (entries), as the per-step aggregate stream.
SAMPLE_INDICES_RETENTION_ENTRIES = 200_000
#: An incident's data position carries the onset step's sample indices themselves up to this many bytes of JSON (a
#: few ranks' batches); beyond it only the entry of ``th:{run}:samples`` that holds them.
INCIDENT_SAMPLE_INDICES_BYTES = 4_096
#: Environment variable overriding ``STEPS_RETENTION_RECORDS``.
RETENTION_ENV = "TRAINHEALTH_RETENTION"
#: Environment variable overriding ``STEPS_RETENTION_BYTES``.
RETENTION_BYTES_ENV = "TRAINHEALTH_RETENTION_BYTES"
#: Environment variables overriding ``AGG_RETENTION_BYTES``, ``LEDGER_RETENTION_BYTES`` and
#: ``ANOMALY_LOG_RETENTION_BYTES`` (read by ``trainhealth serve``, the detector service).
AGG_RETENTION_BYTES_ENV = "TRAINHEALTH_AGG_RETENTION_BYTES"
LEDGER_RETENTION_BYTES_ENV = "TRAINHEALTH_LEDGER_RETENTION_BYTES"
ANOMALY_LOG_RETENTION_BYTES_ENV = "TRAINHEALTH_ANOMALY_LOG_RETENTION_BYTES"

# --- Collectors -----------------------------------------------------------------
#: Bounded in-memory buffer of records waiting to be sent (oldest dropped, counted, beyond it).
COLLECTOR_BUFFER_RECORDS = 100_000
#: Bound of the on-disk spill used when Redis is away and the buffer is half full (bytes).
COLLECTOR_SPILL_BYTES = 256 * 1024 * 1024
#: Records sent in one Redis pipeline by the collector's background thread.
COLLECTOR_BATCH_RECORDS = 1_000
#: Seconds the background thread sleeps between flushes when the buffer is not full. Each
#: flush costs the rank ~0.3 ms of CPU in redis-py, so this bounds the sender's share of a
#: core (~0.1 %) while records still reach the dashboard well within its 2 s refresh.
COLLECTOR_FLUSH_INTERVAL_S = 0.25
#: Seconds between heartbeats (written by the background thread, so they go on while the
#: training thread is stuck; they carry the last completed step so that is visible).
HEARTBEAT_INTERVAL_S = 5.0
#: Reconnect back-off after a Redis error: first wait and cap, in seconds (doubling).
RECONNECT_BACKOFF_S = 0.5
RECONNECT_BACKOFF_MAX_S = 30.0
#: Seconds ``close()`` / interpreter exit waits for the last flush; never hangs the job's exit.
CLOSE_TIMEOUT_S = 5.0
#: Section names whose time counts as data-loading wait in the goodput ledger.
DATA_SECTIONS = ("data", "data_loading", "dataloader", "data_wait")
#: Section names that time a collective (``mon.section("allreduce", cuda=True)`` around the all-reduce a job can
#: wrap): not the rank's own work — left out of its busy time, so a rank that waits longer in the collective is not
#: taken for a slow one — and booked by the ledger as ``communication`` (what the collective took beyond waiting for
#: the slowest rank).
COMM_SECTIONS = ("allreduce", "all_reduce", "comm", "communication", "collective")

# --- Detector service -------------------------------------------------------------
#: Consumer group name of the detector service on every run's streams.
CONSUMER_GROUP = "th-detectors"
#: Milliseconds one ``XREADGROUP`` blocks waiting for new entries.
READ_BLOCK_MS = 1_000
#: Seconds the service waits after a read that caught up with every stream before it reads again, so that the next
#: read takes what the collectors wrote meanwhile in one batch: at a live job's pace every rank's 0.25-s flush
#: arrives on its own and a blocking read returns at each, so each loop's fixed costs (the read, the run registry,
#: the write-back transaction) were paid for a few records (bench/load.py: ~240 loops/s and ~450 µs of CPU a
#: record at 1,024 ranks stepping once a second). What it adds to a detection's latency, at most; a read that did
#: not catch up (a backlog) is followed by the next at once. As Kafka's producer ``linger.ms``.
READ_LINGER_S = 0.1
#: The largest linger accepted (s), by the service and by ``trainhealth serve --linger``.
MAX_READ_LINGER_S = 10.0
#: On Redis Cluster, where one blocking read cannot span the runs' slots: seconds between the non-blocking reads
#: of every run's streams while nothing comes (trainhealth.connection.read_groups); the latency it adds, at most.
CLUSTER_POLL_S = 0.05
#: Entries read per stream per ``XREADGROUP`` call, at most (see READ_RECORDS).
READ_COUNT = 5_000
#: Records one read brings in, about: the entries per stream are READ_RECORDS divided by the records an entry
#: held lately (a fast rank's entry holds up to COLLECTOR_BATCH_RECORDS) and by the runs read, so a catch-up
#: holds ~50,000 records (~15 MB) at a time and a batch is processed in well under a second, not 5,000 x 1,000.
READ_RECORDS = 50_000
#: Seconds between ledger snapshots written per run.
LEDGER_SNAPSHOT_INTERVAL_S = 2.0
#: A step number more than this many times the run's usual step increment past the previous step of its generation
#: (a record logged every step jumping 28 steps; a log written every 200 steps jumping 18,519) skipped steps the
#: records do not cover: records lost, or an excerpt's pasted blocks. The goodput ledger books the time before the
#: step as ``unobserved``, and ``trainhealth analyze`` says the log skips those stretches. 10x: a log's cadence
#: varies by less (the word_lm log's 200 and 383 at epoch ends, 1.9x; every other real log's is constant), and a
#: jump of 10 logged intervals is one nobody reads as the log's pace.
LEDGER_GAP_FACTOR = 10
#: Step increments the ledger waits for before judging the first jumps of a run (the usual increment is the most
#: frequent; the first interval of an excerpt can be its largest jump, 12,695 -> 31,214); LEDGER_HOLD_STEPS at most
#: are held.
LEDGER_MIN_INCREMENTS = 3
LEDGER_HOLD_STEPS = 16
#: TTL in seconds of the service's own heartbeat key.
SERVICE_HEARTBEAT_TTL_S = 30
#: The service writes its heartbeat this often (s), from a thread of its own: a long batch (a catch-up after an
#: outage, a 1,000-rank step) must not let the key expire while the process is alive (rq's worker heartbeat).
SERVICE_HEARTBEAT_INTERVAL_S = 2.0
#: Seconds a detector service's lease on a run lasts without renewal. It is renewed every second by the loop and
#: every SERVICE_HEARTBEAT_INTERVAL_S by the heartbeat thread (a long batch does not lose it), so 6 s survives
#: two missed beats, and a killed service's runs move to the others within about that: failover under 10 s.
RUN_LEASE_S = 6
#: A detector service is counted among those sharing the runs while its last heartbeat (in ``th:services``) is
#: at most this old (s): three beats. A killed service stops counting by the time its leases expire.
SERVICE_LIVE_S = 6.0
#: Members of ``th:services`` silent this long (s) are removed from it.
SERVICE_FORGET_S = 3600.0
#: A run whose processing raised an unexpected error is set aside for this long (s), the other runs going
#: on, then rebuilt from its streams and retried (as rq retries a failed job after a delay).
RUN_RETRY_S = 60.0
#: Seconds after which a step still missing some ranks is closed with the ranks it has.
AGG_STALE_S = 30.0
#: ...and only once a rank is this many steps past it (or a missing rank has a later record): a synchronous job's
#: ranks stay within a step of each other, but a frozen rank's last records wait unsent in its collector (up to
#: COLLECTOR_FLUSH_INTERVAL_S of steps: dozens at 10 ms steps); a job that goes on without a rank gets this far.
AGG_WENT_ON_STEPS = 1000

# --- Detectors ------------------------------------------------------------------
#: Loss spike: trailing window (logged points), warm-up (points; 3 lets a log excerpt with a handful of points
#: before its spike be judged, the small-sample range scale guards it), robust z thresholds to open and close
#: (OLMo-core's StabilityMonitorCallback flags > 6 SD over its trailing window), and a minimum rise to open: the
#: loss at least 1.2x its expected value. 1.2x: a smaller one-point rise is the ordinary batch-to-batch spread of
#: real runs (modded-nanogpt: a +15 % blip every ~100 steps late in training; Megatron Mixtral: +6-14 % blips)
#: and not what the practitioner accounts call a spike (BLOOM-176B 2.2 -> 5.1, PaLM §5.1, the OPT logbook).
#: A log too short for the noise-tail fit (fewer than LOSS_SPIKE_TAIL_MIN_POINTS accepted points: an excerpt, a
#: sparse log) has only z_open, a Hampel margin, to stand for its unknown tail. A point at least this many times
#: *every* point of its window is a spike at the Student-t bound for the window's size (robust.STUDENT_Z) instead:
#: the issue's "a 2-3x jump over every earlier point" (issue 13), its lower end; 2x is also llm-foundry's
#: KillLossSpike outlier multiplier. Chosen on tf_deeplab_steps_checkpoint.log (13000: 2.8x its window's highest
#: point, 4.6 robust SDs against a bound of 4.37 for 28 points) and the BLOOM / 104B excerpts; checked on the other
#: real logs (their first 500 points: no loss is 2x its window's highest with that z). Simulated excerpts of 40
#: points (1,500 each): no added false alarm on log-normal noise (SD 0.05-0.45), +8 to +26 per 10,000 points on
#: Student-t(3) noise of scale 0.2-0.45 (where the detector without it already gives 31). Off for the grad norm,
#: whose tail is heavier (TrOCR: 2x its window's highest at 142 and 414, no loss reaction).
LOSS_SPIKE_RECORD_RATIO = 2.0
LOSS_SPIKE_WINDOW_STEPS = 50
LOSS_SPIKE_WARMUP_STEPS = 3
LOSS_SPIKE_Z_OPEN = 6.5
LOSS_SPIKE_Z_CLOSE = 3.0
LOSS_SPIKE_MIN_REL_RISE = 0.2
#: Grad-norm spikes: same method on log(grad norm), stricter (a grad norm is noisier than a loss).
GRAD_NORM_SPIKE_Z_OPEN = 8.0
GRAD_NORM_SPIKE_MIN_REL_RISE = 1.0
#: ...and on a log too short for its noise tail (an excerpt of a few points), a grad norm an order of magnitude over
#: the window's level is a spike whatever the few points' spread: exploding gradients grow by orders of magnitude
#: (Pascanu, Mikolov and Bengio, ICML 2013), while healthy grad norms of the real logs stay within 3.5x their local
#: median outside the spikes their labels name (bench/labels.toml).
GRAD_NORM_SPIKE_ORDER_JUMP = 10.0
#: Steps a spike may stay elevated before it is ``not_recovered`` (-> divergence), and a rise must last to be
#: divergence. PaLM (§5.1) restarted ~100 steps before a spike that did not recover.
DIVERGENCE_STEPS = 100
#: Incidents: loss-family anomalies whose onsets are within this many steps (or one logging interval, if longer) of
#: a member's are one incident. BLOOM-176B (tr11-176B-ml chronicles): the grad norm left its level at 31215, the
#: loss spiked at 31219, 4 steps later; PaLM §5.1 and OLMo 2 describe grad-norm spikes "shortly" before loss spikes.
#: Twice BLOOM's lead plus a step, rounded.
INCIDENT_STEPS = 10
#: Straggler: steps per window, relative score threshold and consecutive windows below it before flagging.
#: The score is NVRx's (fastest rank's median / the rank's). Threshold 0.8 (a rank ~1.25x slower than the fastest),
#: not NVRx/NeMo's default 0.7 (``gpu_relative_perf_threshold``, ~1.43x): in synchronous training every rank waits
#: for the slowest, so a rank 30 % slower costs the whole job 30 % of its throughput, which on-call wants to know.
#: Healthy spread stays above it (2 % per-GPU speed differences and 5 % step jitter: the healthy 64-rank test's worst
#: score is 0.86; 0 false alarms in bench/detection_eval.py); STRAGGLER_MIN_WINDOWS and STRAGGLER_MIN_EXCESS_S guard.
STRAGGLER_WINDOW_STEPS = 20
STRAGGLER_THRESHOLD = 0.8
STRAGGLER_MIN_WINDOWS = 2
#: Ignore section-time differences below this many seconds (timer jitter on tiny steps).
STRAGGLER_MIN_EXCESS_S = 0.002
#: Hang: no rank completed a step for max(HANG_FLOOR_S, HANG_STEP_MULTIPLE x the longest healthy interval between
#: step completions seen so far) (detectors/progress.py), as NVIDIA's resiliency extension derives its timeouts
#: (observed maximum x safety factor 5.0); HANG_INITIAL_S until HANG_MIN_INTERVALS healthy intervals were seen
#: (a second step that recompiles must not page). Declared phases (checkpoint save/load, badput such as
#: evaluations: heartbeat phase other than ``train``) get HANG_CHECKPOINT_S before they count.
HANG_FLOOR_S = 30.0
HANG_STEP_MULTIPLE = 5.0
HANG_INITIAL_S = 600.0
HANG_MIN_INTERVALS = 5
HANG_CHECKPOINT_S = 1800.0
#: A rank saving or loading a checkpoint may go this long without a heartbeat before it counts as gone (s): pickling
#: a large state can hold the GIL the collector's heartbeat thread needs. Our choice (the progress timeout's floor
#: before the timeout was learned from the intervals); no published figure.
CHECKPOINT_HEARTBEAT_ALLOWANCE_S = 120.0
#: Heartbeats older than this many intervals mean the rank's process is gone: 3 x 5 s, so a rank that stops is
#: named within 20 s (its last heartbeat was at most one interval before it stopped, and the service checks every
#: second).
HEARTBEAT_MISSED_INTERVALS = 3
#: A hang or dead-rank anomaly still open is rewritten with its growing duration at most this often (s): the
#: dashboard and the alert see the current figure without an update per second.
STALL_UPDATE_S = 10.0
#: A job whose every rank's heartbeat is gone is ``crashed`` once no relaunch came this long after the newest
#: heartbeat went stale (s): torchrun's and elastic agents' relaunches take seconds; a scheduler's requeue that
#: comes later turns the state into ``restarted``.
CRASH_GRACE_S = 30.0
#: The job state stays ``restarted`` this long after the first step of a new generation (s), then ``running``.
RESTARTED_HOLD_S = 300.0

# --- Detectors: loss family (skipped steps, spike classes, divergence, grad-norm explosion) ---------
#: Noise-aware spike threshold (extreme value theory, SPOT, Siffer et al. KDD 2017): a spike must also exceed the
#: normalised residual the run's own noise exceeds with probability LOSS_SPIKE_TAIL_RISK per step (times the log's
#: interval per logged point: a point standing for 5 steps takes 5 steps' share of the alarm budget), fitted
#: (generalised Pareto, probability-weighted moments) on the peaks above the LOSS_SPIKE_TAIL_QUANTILE of the last
#: LOSS_SPIKE_TAIL_POINTS accepted points, once LOSS_SPIKE_TAIL_MIN_POINTS are in. 1e-4: at most one false alarm per
#: 10,000 healthy steps. On Gaussian noise it sits near 4 SDs (below LOSS_SPIKE_Z_OPEN: no effect); on the
#: heavy right tail of real losses (hard batches) it rises. Waived when the partner signal (grad norm for the loss,
#: loss for the grad norm) is itself LOSS_SPIKE_CORROBORATE_Z robust SDs up at the same step: two signals agreeing.
#: 2,000 points above their 96th percentile give 80 peaks, about the fewest for a steady generalised Pareto fit
#: (with 500-1,000 points a heavy tail is underestimated: then the other tests carry more of the weight).
LOSS_SPIKE_TAIL_POINTS = 2000
LOSS_SPIKE_TAIL_QUANTILE = 0.96
LOSS_SPIKE_TAIL_RISK = 1e-4
LOSS_SPIKE_TAIL_MIN_POINTS = 500
LOSS_SPIKE_CORROBORATE_Z = 3.0
#: A loss spike has recovered when the loss is back within this fraction of its expected value (or within
#: LOSS_SPIKE_Z_CLOSE robust SDs on a noisy curve).
LOSS_SPIKE_CLOSE_REL = 0.05
#: Recovery classes (``evidence["recovery_class"]``): back within this many steps of the onset is ``fast``,
#: later ``slow``; still elevated DIVERGENCE_STEPS after the onset is ``not_recovered`` (-> divergence). 50 steps:
#: BLOOM-176B's spike at iteration 31219 was back by 31250 on its own (tr11-176B-ml chronicles), and it is the
#: rollback advisor's re-check horizon (ROLLBACK_RECHECK_STEPS): a spike back by then needed no action.
LOSS_SPIKE_FAST_STEPS = 50
#: Divergence by a sustained rise: the loss stays at least DIVERGENCE_MIN_RISE (a fraction) above the best level
#: the run reached, and at least DIVERGENCE_Z robust per-point SDs, for DIVERGENCE_STEPS steps and
#: DIVERGENCE_MIN_POINTS logged points. 20 %: the loss-spike floor, sustained; in the healthy real logs the median
#: of any 100 steps stays within 12 % of the best trailing median reached before (TrOCR 1.12x, LLaMA-Factory 1.10x,
#: Lightning 1.07x, modded-nanogpt 1.07x), and 3 points is the fewest that make a level rather than a 2-point bump
#: on a sparse log.
DIVERGENCE_MIN_RISE = 0.2
DIVERGENCE_Z = 3.0
DIVERGENCE_MIN_POINTS = 3
#: Grad-norm explosion: the grad norm's median since the onset is at least this many times the run's own floor
#: (the lowest trailing median of LOSS_SPIKE_WINDOW_STEPS points, once GRAD_NORM_EXPLOSION_MIN_POINTS points
#: establish it), for DIVERGENCE_STEPS steps and DIVERGENCE_MIN_POINTS points, or sooner while it keeps climbing
#: (another factor over the episode: an exponential blow-up reaches NaN in less than 100 steps). An order of
#: magnitude: exploding gradients grow by orders of magnitude (Pascanu, Mikolov and Bengio, ICML 2013), healthy
#: runs drift by a few x (the real logs: at most 3.3x, TrOCR, whose grad norm lives at 1e5-4e6; near the end of
#: training grad norms rise a few x, Defazio et al. 2025, "Why Gradients Rapidly Increase Near the End of Training").
GRAD_NORM_EXPLOSION_FACTOR = 10.0
GRAD_NORM_EXPLOSION_MIN_POINTS = 20
#: Skipped steps: this many consecutive optimizer steps skipped (fp16 loss-scale overflow) make a ``skipped_steps``
#: anomaly. DeepSpeed and Megatron-LM lower the loss scale only after ``hysteresis`` = 2 consecutive overflows
#: (their default), so up to 2 skips in a row is the scaler doing its job; a third means halving the scale did not
#: stop the overflow. An open loss spike during such a run is ``not_recovered`` (the weights are not updated).
SKIPPED_STEPS_MIN = 3
#: ...except while the loss scaler calibrates at the start (no step applied yet in this generation): halving
#: once per overflow from Megatron-LM's default initial scale 2^32 takes up to 32 skips.
SKIPPED_STEPS_INITIAL = 32
#: NaN/Inf grad norm: on this many logged points in a row, none marked skipped, it is critical (the updates are NaN,
#: or the scaler skips every step without saying so). The reasoning of SKIPPED_STEPS_MIN: two overflows in a row
#: are the fp16 scalers' hysteresis (DeepSpeed, Megatron-LM: 2), a third is not; within SKIPPED_STEPS_INITIAL
#: steps of a generation's start, before any finite grad norm, it is the scale calibrating (a warning) unless the
#: loss on those points is frozen at one value.
NAN_GRAD_NORM_POINTS = 3
#: Applied steps in a row that end a skipped-steps episode (a judgement: ten times the fp16 scalers'
#: hysteresis of 2), so a burst with a few applied steps between overflows is one anomaly.
SKIPPED_STEPS_QUIET = 20

#: Loss collapse: the loss bit-identical on at least LOSS_COLLAPSE_MIN_POINTS logged points in a row, and a run that
#: long improbable (< LOSS_COLLAPSE_RISK) at the rate this log repeats a value by chance, estimated on the
#: transitions of the LOSS_COLLAPSE_HISTORY_POINTS logged points before it. Measured on the real logs: equal pairs
#: occur (hf_overfit_30epochs 2 in 29 transitions, 4-decimal losses near 0.055; LLaMA-Factory Mistral, T5,
#: modded-nanogpt, llm.c), three equal points in a row never. The risk is per logged point and 100x below the spike
#: detectors' 1e-4 budget: a collapse is critical, and on a loss printed to 2 decimals (a repeat rate near 0.26,
#: measured on a simulated plateau) 1e-4 would let the rounding's own longest runs (7-8 points in 3,000) through,
#: while a loss that really froze stays frozen for far more than the 12 points 1e-6 then asks. 500 points: a repeat
#: rate of a few percent known to about +-1 % (our choice).
LOSS_COLLAPSE_MIN_POINTS = 3
LOSS_COLLAPSE_RISK = 1e-6
LOSS_COLLAPSE_HISTORY_POINTS = 500

#: Plateau: the stretch judged is the last PLATEAU_RUN_FRACTION of the steps since the first logged one, at least
#: PLATEAU_MIN_STEPS steps and PLATEAU_MIN_POINTS points (a third of them, >= 33, backs each median: its SE is then
#: ~0.22 per-point SDs; our choice, and it keeps excerpts and sparse logs out); no progress is a relative gain
#: under PLATEAU_MIN_GAIN at the DIVERGENCE_Z upper bound. 1 %: half of what a run on the compute frontier gains
#: over its last third (1.5x compute) by Kaplan et al. 2020's L ~ C^-0.050 (1.5^-0.05 = 0.980). The learning rate
#: must stay >= PLATEAU_LR_FRACTION of the run's peak over the whole stretch: below it the flattening is a decaying
#: schedule's (llm.c GPT-2 and LLaMA-Factory luojiu-7b flatten as their LR decays to ~0; a cosine passes half its
#: peak at mid-run). Checked every PLATEAU_CHECK_POINTS points (and 1 % of those seen), on at most PLATEAU_MAX_POINTS
#: kept (thinned uniformly beyond). None of these was fitted on a file: no real log has a labelled plateau; all stay
#: silent.
PLATEAU_MIN_POINTS = 100
PLATEAU_MIN_STEPS = 500
PLATEAU_RUN_FRACTION = 1 / 3
PLATEAU_MIN_GAIN = 0.01
PLATEAU_LR_FRACTION = 0.5
PLATEAU_CHECK_POINTS = 25
PLATEAU_MAX_POINTS = 6000

# --- Detectors: timing family (throughput drop, slow steps) --------------------------------------
#: Both judge a step's own duration: the live ``mon.step()`` time, else the job's own measurement
#: (``log_step(step_s=)``, a log's time per iteration); never the gap between untimed records (it
#: holds checkpoints and evaluations) nor a replay's assumed pace. They work on log(step time): a
#: slowdown multiplies it. Floor of the robust SD of log step time: 0.005 (0.5 %), about the
#: quantisation of a millisecond timer on a 0.25 s step (modded-nanogpt's log), so a MAD of 0 on
#: a very regular run cannot turn a 1 ms difference into a many-sigma event.
TIMING_MIN_SCALE = 0.005
#: Throughput drop: Page's CUSUM (Page 1954) on standardised log step time against a robust trailing
#: reference (median and 1.4826 x MAD of the last 100 normal timed steps, at least 10 of them after
#: the first 3 of each generation — compilation and cache warm-up). It is designed for a shift of
#: delta = 2 robust SDs: reference value k = delta / 2 = 1 and decision interval h = 4, an in-control
#: average run length of ~15,000 steps by Siegmund's approximation (Montgomery, Introduction to
#: Statistical Quality Control, 6th ed., sec. 9.1; ~37,000 simulated with the winsorising below), i.e.
#: well under 1 false alarm per 10,000 healthy steps. Each standardised value is winsorised at +-2.5
#: (robust CUSUM: Lucas & Crosier 1982): one step adds at most 1.5, so no fewer than 3 steps can raise
#: an alarm, however slow a single step is.
THROUGHPUT_WINDOW_STEPS = 100
THROUGHPUT_WARMUP_STEPS = 3
THROUGHPUT_MIN_REFERENCE_STEPS = 10
THROUGHPUT_CUSUM_K = 1.0
THROUGHPUT_CUSUM_H = 4.0
THROUGHPUT_CLIP = 2.5
#: A drop is reported (onset at the maximum-likelihood change point, Hinkley 1970) only when the median
#: step time since the onset is above the reference by at least the design shift (2 robust SDs: a
#: smaller move is the workload's own variation) and by at least 3 % (a floor: a smaller drop is not
#: worth a page and is within the run-to-run variation of synchronous training; our choice, not a
#: published figure), is higher than the reference itself ever was over as many steps (step times
#: that wander with the data, LLaMA-Factory's fine-tuning log, are not drops), and has held over at
#: least 10 steps by step number (shorter bursts are slow steps, below). Measured: 0 false alarms in
#: 100,000 simulated healthy steps at 0.5-20 % noise; ~0.25 per 10,000 on the Mixtral golden
#: values' own step times resampled. A 10 % drop is found when the step-to-step noise is <= ~5 %.
THROUGHPUT_MIN_SHIFT_SD = 2.0
THROUGHPUT_MIN_REL_CHANGE = 0.03
THROUGHPUT_MIN_STEPS = 10
#: ...and it must last: held over THROUGHPUT_HOLD_STEPS steps by step number, or THROUGHPUT_HOLD_S seconds of
#: wall time (a run of minute-long steps is judged after THROUGHPUT_MIN_STEPS steps, not after hours). A
#: slowdown that ends sooner is a transient the on-call cannot act on. Measured on the live demo on the 2-core
#: machine with one core held by a busy loop (bench/demo_under_load.py, the before runs in BENCHMARKS.md): CPU
#: contention raises the step time 4-6 % (2.5-4.7 robust SDs) for bursts of 10-30 steps (1-2 s), which the
#: previous 10-step floor reported as up to 10 drops a run. Replaying the runs' step times: a 40-step hold was the
#: shortest that left none on the runs it was chosen on, 30 on the later runs it was checked on; 50 keeps a margin
#: and is below the shortest drop of the synthetic corpus (75 steps, --quick). 600 s: the demo's steps
#: (60-100 ms) never reach it before 50 steps; a job of 10 s steps needs 50 steps (8 min) either way, one of
#: 105 s steps (BLOOM-176B) 10 steps (18 min) instead of 50 (1.5 h).
THROUGHPUT_HOLD_STEPS = 50
THROUGHPUT_HOLD_S = 600.0
#: Severity follows the badput: a drop is a ``warning`` when it costs at least 4 % of the run's time
#: (``1 - before / after``), else ``info``. 4 %: twice the largest environmental variation a large run reports
#: (Llama 3 405B: a diurnal 1-2 % throughput variation with the temperature, Grattafiori et al. 2024, "The Llama 3
#: Herd of Models", sec. 3.3.4), the data centre's weather, not a fault to act on; the 3 % floor above it is what
#: can be told from that variation at all. On 1,000 GPUs 4 % is
#: 40 GPUs' worth of work lost for as long as it lasts. An info drop becomes a warning when its level grows past it.
THROUGHPUT_WARNING_LOSS = 0.04
#: Slow step: a step at least 2x the trailing median step time (it lost at least one whole step of
#: time) and more than 6 robust SDs above it (the loss-spike detector's order of strictness; Hampel
#: identifier), against the last 50 normal timed steps. Nothing is reported before that window has
#: filled in a generation (warm-up; it is also how long the rhythm check has to see a period of up
#: to 16 steps three times). Consecutive steps at >= 1.5x and > 3 SDs continue one slow step
#: (hysteresis); a run longer than THROUGHPUT_MIN_STEPS - 1 steps is a level shift, left to the
#: throughput-drop detector (which reports it once it has held THROUGHPUT_HOLD_STEPS or THROUGHPUT_HOLD_S:
#: a slowdown of 10-49 steps shorter than that is a transient, neither).
SLOW_STEP_WINDOW_STEPS = 50
SLOW_STEP_WARMUP_STEPS = SLOW_STEP_WINDOW_STEPS
#: Reference steps needed before a step is judged at all (slow steps are noted from then on, for the
#: rhythm, even inside the warm-up).
SLOW_STEP_MIN_REFERENCE_STEPS = 5
SLOW_STEP_RATIO = 2.0
SLOW_STEP_Z = 6.0
SLOW_STEP_CLOSE_RATIO = 1.5
SLOW_STEP_Z_CLOSE = 3.0
SLOW_STEP_MAX_RUN_STEPS = THROUGHPUT_MIN_STEPS - 1

# --- Detectors: rank family (slow node, rank outlier, dead rank, restart storm) ------------------
#: Slow node: a host is slow in a window when more than this fraction of its ranks score below
#: STRAGGLER_THRESHOLD (the same NVRx relative score, same windows); it needs at least
#: SLOW_NODE_MIN_RANKS ranks with data and a second host to compare with. Persistence as the
#: straggler's (no more windows than it, so the node is named before its ranks become stragglers).
SLOW_NODE_FRACTION = 0.5
SLOW_NODE_MIN_RANKS = 2
SLOW_NODE_MIN_WINDOWS = 2
#: Network on one node (detectors/network.py): per window of STRAGGLER_WINDOW_STEPS steps, a rank's communication
#: share (seconds in its collective beyond the wait for the slowest rank, over the step's time) is high when it is
#: NETWORK_RATIO x the other nodes' median share or more (1 / STRAGGLER_THRESHOLD: the straggler's relative score of
#: 0.8 read on the collective instead of the sections) and NETWORK_MIN_EXCESS of the step above it (the throughput
#: detector's 3 % floor, THROUGHPUT_MIN_REL_CHANGE: less cannot be told from a data centre's weather). A node is
#: flagged when more than SLOW_NODE_FRACTION of its ranks (at least SLOW_NODE_MIN_RANKS) are high, for
#: NETWORK_MIN_WINDOWS windows in a row (the slow node's persistence); a warning from THROUGHPUT_WARNING_LOSS of the
#: job's time lost, else info.
NETWORK_RATIO = 1.0 / STRAGGLER_THRESHOLD
NETWORK_MIN_EXCESS = THROUGHPUT_MIN_REL_CHANGE
NETWORK_MIN_WINDOWS = SLOW_NODE_MIN_WINDOWS
#: Rank outlier (Isolation Forest, Liu, Ting & Zhou 2008, scikit-learn ``IsolationForest``) over
#: per-rank window features. Needs this many ranks (a median/MAD and a forest over fewer are noise).
RANK_OUTLIER_WINDOW_STEPS = 20
RANK_OUTLIER_MIN_RANKS = 8
#: Materiality gate: a candidate rank is worse than the ranks' median by at least this robust z
#: (deviation / max(1.4826 x MAD, floor); 3 = Leys et al. 2013's "very conservative" MAD cut-off)
#: in at least this many features at once.
RANK_OUTLIER_Z = 3.0
RANK_OUTLIER_MIN_FEATURES = 2
#: An open rank outlier stays open while still this far off in as many features (hysteresis).
RANK_OUTLIER_Z_CLOSE = 2.0
#: Floors of each feature's scale, so a job whose ranks are nearly identical (tiny MAD) does not
#: turn timer noise into large z: relative section time 2 %, its IQR/median 0.02, data-loading share
#: 2 points, missing steps 5 % (1 step in a 20-step window).
RANK_OUTLIER_FLOORS = (0.02, 0.02, 0.02, 0.05)
#: Isolation score s (the paper's 2^(-E[h]/c(n)), = -score_samples) a candidate must reach: above
#: scikit-learn's contamination="auto" cut-off of 0.5, with a margin.
RANK_OUTLIER_SCORE = 0.6
#: Consecutive flagged windows before opening (one more than the straggler's: it is the fuzzier test).
RANK_OUTLIER_MIN_WINDOWS = 3
RANK_OUTLIER_TREES = 100
RANK_OUTLIER_SEED = 0
#: Dead rank "stuck alone": besides the progress timeout, the rank's own heartbeat must be written at least this
#: many heartbeat intervals after another rank was first seen past its step and still show the old step. One
#: interval: the heartbeats are written every HEARTBEAT_INTERVAL_S at each rank's own offset, so after a long pause
#: a rank's latest one may predate the first step after it; a second: a rank finishing the same step a little
#: after the others (pipeline stages). Our choice, from the heartbeat protocol (no published figure).
DEAD_RANK_EVIDENCE_INTERVALS = 2.0
#: Restart storm: this many restarts (new generations) within this many seconds of wall time. A job
#: failing more often than every 20 min loses most of its time to restarts and recomputation; the
#: same idea as Kubernetes CrashLoopBackOff and torchrun's ``--max-restarts`` budget.
RESTART_STORM_COUNT = 3
RESTART_STORM_WINDOW_S = 3600.0

# --- Detectors: memory (detectors/memory_growth.py, detectors/memory_pressure.py) -----------------------
#: Window of a rank's memory trend (s): 30 min of 5-s heartbeat samples.
MEMORY_WINDOW_S = 1800.0
#: Shortest span judged (s) and fewest samples: a trend of less than 10 minutes is a warm-up, not a leak.
MEMORY_MIN_SPAN_S = 600.0
MEMORY_MIN_SAMPLES = 20
#: Most floors the Theil–Sen line is fitted on (pairwise slopes: 1,770 at 60).
MEMORY_MAX_POINTS = 60
#: Seconds of samples whose lowest is one point of the trend (12 heartbeats): the memory left between steps.
MEMORY_BUCKET_S = 60.0
#: Growth over the window, as a fraction of the device's or host's memory, that opens (819 MiB of 80 GiB in 30 min:
#: a leak that fills the device in a day or two is seen within the hour it starts).
MEMORY_GROWTH_FRAC = 0.01
#: Steadiness of that growth: Spearman's rho of memory with time (a leak climbs; a cache's saw-tooth does not).
MEMORY_MIN_RHO = 0.9
#: Capacity reached within this many seconds at the current slope: critical (an hour to act), else warning within
#: a day, else info (the job may well end first).
MEMORY_CRITICAL_WITHIN_S = 3600.0
MEMORY_WARNING_WITHIN_S = 86400.0
#: A rank whose last sample shows this share of its CUDA device reserved, with allocation retries (cache flushes,
#: PyTorch's sign of memory pressure) in its last minute, or this share of its host's (or cgroup's) memory in its
#: RSS, died "likely out of memory".
MEMORY_PRESSURE_FRAC = 0.9
#: Seconds before the last sample in which new allocation retries or OOMs count as pressure at death.
MEMORY_PRESSURE_RECENT_S = 60.0
#: Memory imbalance (detectors/memory_imbalance.py): a rank's CUDA peak allocation is an outlier among the ranks'
#: by the modified z-score (0.6745 x deviation / MAD, > 3.5: Iglewicz & Hoaglin 1993's cut-off for outliers) and at
#: least MEMORY_IMBALANCE_FRAC of its device above the ranks' median: the headroom MEMORY_PRESSURE_FRAC leaves, so
#: that rank runs out of memory while the others still have all of theirs. Judged with at least
#: MEMORY_IMBALANCE_MIN_RANKS ranks reporting (a median and MAD of fewer say little), on MEMORY_IMBALANCE_MIN_SAMPLES
#: heartbeats in a row (15 s: not one sample taken mid-allocation). A warning when the rank's peak is at least
#: MEMORY_PRESSURE_FRAC of its device (it is near its limit), else info.
MEMORY_IMBALANCE_Z = 3.5
MEMORY_IMBALANCE_FRAC = 1.0 - MEMORY_PRESSURE_FRAC
MEMORY_IMBALANCE_MIN_RANKS = 4
MEMORY_IMBALANCE_MIN_SAMPLES = 3
#: The per-rank memory history the service keeps for the dashboard (th:{run}:mem): one entry of every rank's newest
#: heartbeat sample each MEMORY_HISTORY_S seconds, the newest MEMORY_HISTORY_ENTRIES kept (24 h). At 1,024 ranks an
#: entry is ~20 kB (three lists of MiB): ~55 MB a run, a sixth of its steps stream (docs/architecture.md).
MEMORY_HISTORY_S = 30.0
MEMORY_HISTORY_ENTRIES = 2_880

# --- Rollback advisor -------------------------------------------------------------------
#: Restart from a checkpoint at least this many steps before the onset (PaLM: ~100 steps).
ROLLBACK_MARGIN_STEPS = 100
#: ...whose preceding steps were free of loss anomalies for this many steps.
ROLLBACK_HEALTHY_STEPS = 50
#: Skip the batches from this many steps before the onset to this many after it (PaLM
#: skipped roughly 200-500 batches around each spike).
ROLLBACK_SKIP_BEFORE_STEPS = 100
ROLLBACK_SKIP_AFTER_STEPS = 200
#: A spike younger than this (steps) gets "wait and re-check" instead of a rollback.
ROLLBACK_RECHECK_STEPS = 50
#: This many spikes within the window (steps) count as repeated: suggest lower LR / clipping.
REPEAT_SPIKES = 3
REPEAT_SPIKES_WINDOW_STEPS = 5000

# --- Dashboard ------------------------------------------------------------------------
#: Seconds between live refreshes of the dashboard's fragments.
DASHBOARD_REFRESH_S = 2.0
#: Steps shown in the dashboard's charts (the newest ones).
DASHBOARD_STEPS = 2_000
DASHBOARD_PORT = 8501

# --- Prometheus exporter (detectors/exporter.py, docs/metrics.md) ---------------------------------------------
#: ``trainhealth exporter --port``: ours (Prometheus' register of exporter ports, 9100-9999, is full; change it
#: with the flag when another exporter of the host has it).
EXPORTER_PORT = 9479
#: Per run, the newest step's k slowest ranks get a series each (``trainhealth_rank_straggler_score``): a few
#: series per run whatever the world size, enough to name a straggler and its runners-up.
EXPORTER_SLOWEST_RANKS = 5
#: An ended run stays exported this long (s), so its final figures reach Prometheus at any scrape interval; then
#: its series end (Prometheus keeps their history).
EXPORTER_ENDED_KEEP_S = 3600.0

# --- Alerts (issue 6; detectors/alerts, docs/alerts.md) -------------------------------------------
#: Grouping timers, Prometheus Alertmanager's defaults (prometheus.io/docs/alerting/latest/configuration/
#: ``route``): wait before a new group's first notification, between notifications about changes of a
#: group, and before re-sending an unchanged firing group.
ALERT_GROUP_WAIT_S = 30.0
ALERT_GROUP_INTERVAL_S = 300.0
ALERT_REPEAT_INTERVAL_S = 4 * 3600.0
#: Labels alerts are grouped by when the config does not say.
ALERT_GROUP_BY = ("run", "kind")
#: Delivery: tries before a notification goes to the dead-letter list, exponential backoff (first delay,
#: cap, jitter fraction: a delay d becomes d x (1 - jitter x U[0, 1))) and the cap on a server's
#: ``Retry-After`` (seconds). 12 tries with 1 s doubling to 5 min span about 20 minutes.
ALERT_MAX_ATTEMPTS = 12
ALERT_BACKOFF_BASE_S = 1.0
ALERT_BACKOFF_MAX_S = 300.0
ALERT_BACKOFF_JITTER = 0.5
ALERT_RETRY_AFTER_MAX_S = 3600.0
#: Seconds one HTTP request to a sink may take (connect + read) before it counts as failed.
ALERT_HTTP_TIMEOUT_S = 10.0
#: Consumer groups of the alert worker on every run's anomaly_log and on the outbox.
ALERT_CONSUMER_GROUP = "th-alerts"
ALERT_DELIVERY_GROUP = "th-alerts-delivery"
#: TTL in seconds of the alert worker's heartbeat key, and of its leadership lease (renewed every ~1 s).
ALERT_WORKER_HEARTBEAT_TTL_S = 30
ALERT_LEASE_S = 15
#: On its very first start the worker ignores anomaly transitions older than this (seconds), so that
#: deploying alerting on a Redis with months of history does not notify all of it.
ALERT_BACKFILL_S = 3600.0
#: Approximate entries kept in the outbox and sent-log streams, and in the dead-letter list.
ALERT_OUTBOX_RETENTION_ENTRIES = 100_000
ALERT_SENT_RETENTION_ENTRIES = 10_000
ALERT_DEAD_RETENTION_ENTRIES = 10_000
#: Alerts detailed in one Slack message (Block Kit allows 50 blocks a message; an alert takes up to 6);
#: the others are counted in a last line.
ALERT_SLACK_MAX_ALERTS = 6
#: Watchdog: ranks sending heartbeats while no detector service heartbeat is younger than this (s)
#: raises the ``service_down`` alert.
ALERT_SERVICE_STALE_S = 60.0
#: Dashboard base URL used in notification links when the config does not give one.
ALERT_DASHBOARD_URL = "http://127.0.0.1:8501"
#: Alertmanager sinks (alerts/forwarding.py): an active alert is re-sent every ``resend_interval`` (s), Prometheus's
#: own default (``--rules.alert.resend-delay`` 1m), and each send says it is valid for ``ALERT_AM_VALIDITY_FACTOR``
#: intervals (``endsAt``), as Prometheus does (``rules/alerting.go``: ``ValidUntil = ts + 4 * max(interval,
#: resend delay)``, "allow for two eval or Alertmanager send failures"): a worker that stops sending lets
#: Alertmanager resolve its alerts 4 min after the last send, and up to three failed sends in a row change nothing.
ALERT_AM_RESEND_INTERVAL_S = 60.0
ALERT_AM_VALIDITY_FACTOR = 4
#: Alerts per POST to Alertmanager: Prometheus's notifier batch (``notifier.maxBatchSize`` = 64).
ALERT_AM_BATCH = 64
#: The ``rank`` / ``host`` labels an Alertmanager alert carries only up to this many ranks / hosts (one node's 8 GPUs):
#: labels identify an alert and are matched by routes, a job-wide rank list is neither (the annotations list them all).
ALERT_AM_MAX_LABEL_MEMBERS = 8

# --- Recovery advice (detectors/recovery_advisor.py) ---
#: Seconds after a hang's onset (no progress) after which the advice turns from "dump the stacks and wait"
#: to "restart": PyTorch's default NCCL watchdog timeout (``torch.distributed.constants.default_pg_nccl_timeout``,
#: 10 min), after which the job aborts its collectives by itself, so waiting longer only burns the allocation.
HANG_RESTART_AFTER_S = 600.0
#: Seconds a relaunch costs (scheduler, container and interpreter startup, NCCL init, checkpoint restore) when the
#: run has not measured one: 5 min, an assumption for a multi-node job (the "program startup" and "training
#: preparation" badput of Google's ml-goodput-measurement); a measured relaunch of the run replaces it.
RESTART_OVERHEAD_S = 300.0
#: Replace a straggler or slow node when a restart without it pays for itself within this many hours of the time
#: it costs the job: past that, advising a restart is noise (the run may end, or the node recover, first).
REPLACE_NODE_BREAK_EVEN_H = 1.0

# --- Alert worker catch-up (alerts/intake.py) ---
#: Catch-up window (s; ``trainhealth alerts --catch-up``). At worker start, anomaly transitions whose
#: ``anomaly_log`` entry was written longer ago than this are applied to the alert groups without notifying,
#: and a run whose meta ``status`` is not ``running`` and whose last transition is this old is not paged.
#: 10 min is twice Prometheus Alertmanager's default ``group_interval`` and ``resolve_timeout`` (5 min each;
#: Alertmanager itself treats an alert not re-sent for 5 min as resolved): a worker restart (a crash restarted
#: by systemd, a redeploy, a standby taking over after the 15 s lease) is back within seconds, so nothing
#: it would have sent on time is held back, while anything older would reach on-call at least two group
#: intervals late: history, not a page. It is also PyTorch's NCCL watchdog timeout (HANG_RESTART_AFTER_S),
#: after which a hung job has aborted by itself.
ALERT_CATCHUP_S = 600.0
#: A straggler or slow node costing less than this share of the job's time gets no recommendation (keeping it is the
#: obvious answer, and a "Keep" card saying "costs 0.0 %" is noise); the anomaly itself still shows. Our choice:
#: the throughput detector's own floor for a drop worth a warning is 4 %.
SLOW_RANK_MIN_LOSS = 0.01

#: Learning progress per GPU-hour (detectors/progress_rate.py): the loss improvement of a stretch is the median of its
#: first PROGRESS_POINTS finite losses minus the median of its last PROGRESS_POINTS, each block at most a third of the
#: stretch's points (the two stay apart, as the plateau's thirds) and at least PROGRESS_MIN_POINTS (a median of 3
#: resists one spike at either end; fewer points give no figure). Odd, so each median is one point whose time and
#: kept-token count the rate is measured between. Our choice, not fitted on a file.
PROGRESS_POINTS = 21
PROGRESS_MIN_POINTS = 3

#: Over-fitting (detectors/overfitting.py): Prechelt 1998's generalization loss GL(t) = 100 (E_va(t) / E_opt(t) - 1)
#: above OVERFIT_GL_PCT (his GL_5, the slowest of the GL criteria he compared: the fewest early stops), its eval
#: loss risen at each of the last OVERFIT_RISES evaluations (his UP_s with s = 2: one noisy evaluation is not a trend;
#: TrOCR's eval loss rises once by 10 % at step 800 and falls after) while the training loss fell over the same
#: evaluations (median of its last OVERFIT_TRAIN_POINTS logged points; a rising training loss with it is a failing run,
#: not over-fitting: Whisper's lr-too-high fine-tune, whose eval loss rises 3.195 -> 3.959 -> 3.984 at 528-792, 56 %
#: above its best, with its training loss at 1.24 then 2.03). Chosen on hf_overfit_30epochs and hf_trocr_large_gradnorm:
#: over GL 1-20 % x 1-3 rises, 1 rise fires on TrOCR's one bump (step 800) for GL <= 10 %, 3 rises fire an epoch later
#: on the over-fitting run (1604 instead of 1203), and GL from 1 to 20 % changes nothing on these files (5 % is
#: Prechelt's, not fitted). Reported on hf_tinyllama_sft_healthy, hf_whisper_small_lr_too_high,
#: llamafactory_luojiu7b_cpt, lightning_slm_wikitext103, llmc_gpt2_124m_main: silent at every one of those settings.
OVERFIT_GL_PCT = 5.0
OVERFIT_RISES = 2
OVERFIT_TRAIN_POINTS = 3
