"""The range checks the queue, the camera side and the event memory share: their bounds and their messages."""

from __future__ import annotations

import math

import pytest

from jobqueue.checks import at_least, not_negative, positive, positive_count


@pytest.mark.parametrize(("check", "args", "message"), [
    (at_least, ("batch_size", 0, 1), "batch_size must be at least 1, got 0"),
    (at_least, ("event_frame_size", 15, 16, " pixels"), "event_frame_size must be at least 16 pixels, got 15"),
    (not_negative, ("alert webhook backoff", -0.5), "alert webhook backoff must not be negative, got -0.5"),
    (positive, ("fps", 0), "fps must be positive, got 0"),
    (positive, ("watchdog_seconds", -1.5), "watchdog_seconds must be positive, got -1.5"),
    (positive_count, ("max_pending", 0), "max_pending must be positive, got 0"),
    (positive_count, ("max_frames", 0.5), "max_frames must be positive, got 0.5"),
])
def test_a_value_out_of_range_is_refused_with_its_name_and_value(check, args, message):
    with pytest.raises(ValueError) as refused:
        check(*args)
    assert str(refused.value) == message


@pytest.mark.parametrize(("check", "args"), [
    (at_least, ("batch_size", 1, 1)),
    (at_least, ("event_frame_size", 16, 16, " pixels")),
    (not_negative, ("claim_idle_seconds", 0)),
    (positive, ("fps", 0.001)),
    (positive_count, ("max_pending", 1)),
    (positive, ("fps", math.nan)),  # as the checks it replaced: `nan <= 0` is false
])
def test_a_value_in_range_passes(check, args):
    assert check(*args) is None
