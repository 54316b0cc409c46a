// The Boost.Test module of test_train (the cases live in test_idx.cpp and
// test_mlp.cpp).
#define BOOST_TEST_MODULE test_train
#include <boost/test/unit_test.hpp>
