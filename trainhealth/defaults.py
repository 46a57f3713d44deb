"""Documented defaults, in one place. Every tunable elsewhere refers here.

Units are in the names: ``_S`` seconds, ``_STEPS`` steps, ``_ENTRIES`` stream entries.
"""

from __future__ import annotations

# --- Redis -------------------------------------------------------------------
#: Environment variable holding the Redis URL (``redis://``, ``rediss://``, ``unix://``).
REDIS_URL_ENV = "TRAINHEALTH_REDIS_URL"
#: Environment variable overriding the embedded server's home (data, pid, port files).
HOME_ENV = "TRAINHEALTH_HOME"
#: Embedded server's default home, under the user's home directory.
HOME_DIR = "~/.trainhealth"
#: Port the embedded redis-server tries first; the next free port is taken if it is busy.
EMBEDDED_PORT = 6390
#: Seconds to wait for the embedded redis-server to answer PING after starting it.
EMBEDDED_START_TIMEOUT_S = 10.0

# --- Streams and retention -----------------------------------------------------
#: Approximate maximum entries kept per run in the per-rank step stream (``XADD MAXLEN ~``).
#: About 250 bytes an entry: 1,000,000 entries ≈ 250 MB of Redis memory per run.
STEPS_RETENTION_ENTRIES = 1_000_000
#: Approximate maximum entries kept in the events, per-step aggregate and ledger streams.
EVENTS_RETENTION_ENTRIES = 100_000
AGG_RETENTION_ENTRIES = 200_000
LEDGER_RETENTION_ENTRIES = 20_000
#: Environment variable overriding ``STEPS_RETENTION_ENTRIES``.
RETENTION_ENV = "TRAINHEALTH_RETENTION"

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

# --- Detector service -------------------------------------------------------------
#: Consumer group name of the detector service on every run's streams.
CONSUMER_GROUP = "th-detectors"
#: Milliseconds one ``XREADGROUP`` blocks waiting for new entries.
READ_BLOCK_MS = 1_000
#: Entries read per stream per ``XREADGROUP`` call.
READ_COUNT = 5_000
#: Seconds between ledger snapshots written per run.
LEDGER_SNAPSHOT_INTERVAL_S = 2.0
#: TTL in seconds of the service's own heartbeat key.
SERVICE_HEARTBEAT_TTL_S = 30
#: Seconds a detector service's lease on a run lasts without renewal (renewed every ~1 s).
RUN_LEASE_S = 15
#: Seconds after which a step still missing some ranks is closed with the ranks it has.
AGG_STALE_S = 30.0

# --- Detectors ------------------------------------------------------------------
#: Loss spike: trailing window (steps), warm-up, robust z thresholds to open and close,
#: and a minimum relative rise so a nearly flat curve's tiny MAD cannot trigger on noise.
LOSS_SPIKE_WINDOW_STEPS = 50
LOSS_SPIKE_WARMUP_STEPS = 10
LOSS_SPIKE_Z_OPEN = 6.5
LOSS_SPIKE_Z_CLOSE = 3.0
LOSS_SPIKE_MIN_REL_RISE = 0.05
#: Grad-norm spikes: same method on log(grad norm), stricter (a grad norm is noisier than a loss).
GRAD_NORM_SPIKE_Z_OPEN = 8.0
GRAD_NORM_SPIKE_MIN_REL_RISE = 1.0
#: A spike still open after this many steps is reported as divergence as well.
DIVERGENCE_STEPS = 100
#: Straggler: steps per window, relative score threshold (NVRx/NeMo default 0.7 for
#: ``gpu_relative_perf_threshold``) and consecutive windows below it before flagging.
STRAGGLER_WINDOW_STEPS = 20
STRAGGLER_THRESHOLD = 0.7
STRAGGLER_MIN_WINDOWS = 2
#: Ignore section-time differences below this many seconds (timer jitter on tiny steps).
STRAGGLER_MIN_EXCESS_S = 0.002
#: Hang: a rank with no completed step for max(HANG_FLOOR_S, HANG_STEP_MULTIPLE x median
#: step time) is hung; checkpoint saves get HANG_CHECKPOINT_S before they count.
HANG_FLOOR_S = 120.0
HANG_STEP_MULTIPLE = 20.0
HANG_CHECKPOINT_S = 1800.0
#: Heartbeats older than this many intervals mean the rank's process is gone.
HEARTBEAT_MISSED_INTERVALS = 4

# --- Detectors: loss family (skipped steps, spike classes, divergence, grad-norm explosion) ---------

# --- Detectors: timing family (throughput drop, slow steps) --------------------------------------

# --- Detectors: rank family (slow node, rank outlier, dead rank, restart storm) ------------------

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
