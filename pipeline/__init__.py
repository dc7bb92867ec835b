"""The camera side: capture, frame, detector, tracker, gate, runner and published counters. It produces jobs
through `jobqueue` and never imports the engine or the HTTP server."""
