"""``python -m reshard``: the ``reshard`` command, also what ``torchrun … -m reshard convert …`` starts on each rank.

It sits above every layer, the command line included, as the installed ``reshard`` script does.
"""

from reshard.cli.main import main

if __name__ == "__main__":
    main()
