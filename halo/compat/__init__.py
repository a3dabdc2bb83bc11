"""Drop-in APIs of the libraries halo's users come from: ``halo.compat.credit`` (NCAR CREDIT)."""
