"""Sinks that write files on rank 0: TensorBoard event files and CSV files, laid out as
DeepSpeed lays them out (`<output_path>/<job_name>/`)."""
from __future__ import annotations

import csv
import os
from typing import Dict, Sequence

from .sink import Event, MetricsSink


def job_dir(output_path: str, job_name: str) -> str:
    # DeepSpeed joins them as given: an empty output_path puts the job folder in the working directory.
    path = os.path.join(output_path or "", job_name)
    os.makedirs(path, exist_ok=True)
    return path


class TensorBoardSink(MetricsSink):
    name = "tensorboard"

    def __init__(self, output_path: str, job_name: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = job_dir(output_path, job_name)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, x in events:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CSVSink(MetricsSink):
    """One file per event, `Train_Samples_train_loss.csv` with rows `step,<last name part>`,
    appended as events arrive (a crashed run keeps everything written so far)."""

    name = "csv_monitor"

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = job_dir(output_path, job_name)
        self._started: Dict[str, bool] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, x in events:
            filename = name.replace("/", "_").replace(" ", "_") + ".csv"
            path = os.path.join(self.log_dir, filename)
            new = filename not in self._started and not os.path.exists(path)
            with open(path, "a", newline="") as fh:
                writer = csv.writer(fh)
                if new:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([x, value])
            self._started[filename] = True
