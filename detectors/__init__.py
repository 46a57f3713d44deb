"""The detector service: streaming anomaly detectors, the goodput ledger and the rollback advisor.

One detector per module (``loss_spike.py``, ``straggler.py``, …), pure logic on numbers; their shared
rolling statistics in :mod:`trainhealth.detectors.robust`; :mod:`~trainhealth.detectors.pipeline` runs
them over one run's records; :mod:`~trainhealth.detectors.service` is the Redis loop
(``trainhealth serve``); :mod:`~trainhealth.detectors.offline` runs the same pipeline over a parsed log.
"""
