"""optimum-ipu-backend's commands for ``optimum-cli``: ``optimum-cli ipu ...`` and ``optimum-cli export ipu``.

``optimum-cli`` imports every module of the PEP 420 namespace ``optimum.commands.register`` (so this
directory has no ``__init__.py``) and registers its ``REGISTER_COMMANDS``. Kept to imports: the commands
live in ``optimum_ipu_backend.cli.optimum_cli``.
"""

from optimum.commands.export.base import ExportCommand

from optimum_ipu_backend.cli.optimum_cli import IPUCommand, IPUExportCommand

REGISTER_COMMANDS = [IPUCommand, (IPUExportCommand, ExportCommand)]
