"""The wheel carries conf/ as vdtrain/conf: the Hydra apps compose from it when no repository's conf/ sits
beside the package (``vdtrain.paths.CONF_DIR``). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConf(build_py):
    """build_py, then a copy of the repository's conf/ into the built package (not for an editable
    install, which reads conf/ in place)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            conf = Path(__file__).resolve().parent / "conf"
            shutil.copytree(conf, Path(self.build_lib) / "vdtrain" / "conf", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithConf})
