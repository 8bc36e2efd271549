"""`python -m ssd_core.calibrate`: rebuild every calibration artefact (see calibration.build)."""
from .calibration.build import main

if __name__ == "__main__":
    main()
