"""`python -m nextn.config > docs/flags.md`: the flag reference, from the configuration dataclasses."""

from nextn.config.reference import reference

if __name__ == "__main__":
    print(reference(), end="")
