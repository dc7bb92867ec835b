"""`vlmcap demo`: embedded Redis, the server and its dashboard, and a camera pipeline over the sample video."""

from __future__ import annotations

import typer


def demo(
    model: str = typer.Option(None, help="Model to serve (default: HuggingFaceTB/SmolVLM-256M-Instruct when it "
                                         "can be downloaded, else the random-weight 'tiny')."),
    detector: str = typer.Option(None, help="'people-fall', 'hog' or YOLO weights (default: people-fall, which "
                                            "tells falls, else HOG)."),
    source: str = typer.Option(None, help="Camera source instead of the bundled samples/people.mp4."),
    once: bool = typer.Option(False, "--once", help="One pass over the video as fast as the detector goes, then "
                                                    "exit when every job has its caption (default: real time, "
                                                    "looping, until Ctrl-C)."),
    port: int = typer.Option(8000, help="Port of the server and its dashboard on 127.0.0.1 (0: any free one)."),
    timeout: float = typer.Option(900.0, help="With --once: give up when captions are still arriving after this "
                                              "many seconds."),
) -> None:
    """Play the sample video through the whole product: print each caption and fall alert as it arrives."""
    import logging

    from api.demo import run_demo

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if run_demo(model, detector, source, timeout, once=once, port=port) == 0 and once:
        raise typer.Exit(1)
