"""``RUN_DIR/calibration.json``: a run's online calibration, read back by a resumed run as
it was written; a bad file is one line naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearl.core.calibration import BatchCalibration
from pearl.io.documents import InputError
from pearl.run.coordinated import read_calibration, write_calibration


def test_the_calibration_round_trips_and_starts_at_one_without_a_file(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    assert read_calibration(path).factor == 1.0 and read_calibration(path).batches == 0
    calibration = BatchCalibration()
    calibration.observe(predicted_s=2.0, measured_s=5.0, used_factor=1.0)
    calibration.observe(predicted_s=4.0, measured_s=3.0, used_factor=calibration.factor)
    write_calibration(path, calibration)
    again = read_calibration(path)
    assert (again.log_factor, again.batches) == (calibration.log_factor, 2)
    assert again.factor == calibration.factor


def test_a_bad_calibration_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text('{"log_factor": "much", "batches": 2}\n')
    with pytest.raises(InputError, match=r"calibration.json: log_factor: "):
        read_calibration(path)
