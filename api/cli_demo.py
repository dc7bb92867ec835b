"""`vlmcap demo`: embedded Redis, the server and a camera pipeline over the sample video."""

from __future__ import annotations

import typer


def demo(
    model: str = typer.Option(None, help="Model to serve (default: HuggingFaceTB/SmolVLM-256M-Instruct when it "
                                         "can be downloaded, else the random-weight 'tiny')."),
    detector: str = typer.Option(None, help="'hog' or YOLO weights (default: yolo26n.pt, else HOG)."),
    source: str = typer.Option(None, help="Camera source instead of the bundled samples/people.mp4."),
    timeout: float = typer.Option(900.0, help="Give up when captions are still arriving after this many seconds."),
) -> None:
    """Caption the people of the sample video end to end and print each caption as it arrives."""
    import logging

    from api.demo import run_demo

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if run_demo(model, detector, source, timeout) == 0:
        raise typer.Exit(1)
