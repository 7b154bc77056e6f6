"""Everything is in pyproject.toml except one file: `megatrain-guard.pth`, placed at the top of site-packages in
wheels and editable installs alike, which loads `megatrain/_startup.py` at interpreter start-up (why: that file's
docstring). setuptools has no declarative way to place a file there."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "megatrain-guard.pth"
# One line, as `site` runs it: find the installed package without importing it, run its _startup.py by path.
PTH_LINE = ("import importlib.util as u, os.path as p; s = u.find_spec('megatrain'); "
            "o = s and s.origin and p.join(p.dirname(s.origin), '_startup.py'); "
            "f = o and p.isfile(o) and u.spec_from_file_location('_megatrain_startup', o); "
            "f and f.loader.exec_module(u.module_from_spec(f))\n")


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        Path(self.build_lib, PTH).write_text(PTH_LINE)


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):  # noqa: ANN002, ANN003
        strategy = super()._select_strategy(*args, **kwargs)

        class WithPth:
            def __call__(self, wheel, files, mapping):  # noqa: ANN001
                strategy(wheel, files, mapping)
                wheel.writestr(PTH, PTH_LINE)

            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc):  # noqa: ANN002
                return strategy.__exit__(*exc)

        return WithPth()


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
