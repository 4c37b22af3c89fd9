"""What the apps share below them: plain helpers that know no app (the bottom layer; config wires
it in, accounts and inference use it)."""
