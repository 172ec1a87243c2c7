"""The embedded local stack (broker + Redis) for laptops, tests and CI."""
